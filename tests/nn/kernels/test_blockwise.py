"""The blockwise (online-softmax) kriging attention against the materialised reference."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import full_keep_mask, inputs, max_diff, reference, weighted_sum

from bft_lightning.nn.attention import build_allowed
from bft_lightning.nn.kernels.blockwise import (
    blockwise_attention,
    blockwise_backward,
    blockwise_forward,
    keep_threshold,
)


def _drawn_seed(seed: int) -> int:
    """The dropout seed a call draws after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return int(torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).item())


def _compare(q, k, v, bias, allowed, call, atol, keep=None, factor=1.0):
    """Values and gradients (q, k, v, bias) of ``call`` against the reference, with
    every output in the loss."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    leaves_ref = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    got = call(*leaves)
    ref = reference(*leaves_ref[:3], allowed, leaves_ref[3], keep, factor)
    assert max_diff(got, ref) < atol
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(r.shape, generator=g, dtype=r.dtype) for r in ref]
    grads = torch.autograd.grad(weighted_sum(got, w), leaves)
    grads_ref = torch.autograd.grad(weighted_sum(ref, w), leaves_ref)
    assert max_diff(grads, grads_ref) < atol
    return got


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("masks", ["allowed", "key_valid"])
def test_values_and_gradients_equal_reference(causal, block, masks):
    """float64, T = 13 (blocks that divide it and blocks that do not), left padding,
    rows with no key (causal padding, a sequence with one key), both mask forms."""
    b, h, t, dh = 3, 2, 13, 4
    q, k, v, bias, valid, allowed = inputs(b, h, t, dh, causal, pad=4, seed=block)

    def call(q, k, v, bias):
        if masks == "allowed":
            return blockwise_attention(q, k, v, allowed, bias, 0.0, block)
        return blockwise_attention(
            q, k, v, None, bias, 0.0, block, key_valid=valid, is_causal=causal
        )

    got = _compare(q, k, v, bias, allowed, call, atol=1e-12)
    empty = ~allowed.any(dim=-1)[:, 0]  # (B, T) rows with no key
    assert empty.any()
    for x in got:
        rows = x[empty.unsqueeze(1).expand(b, h, t)]
        assert torch.equal(rows, torch.zeros_like(rows))


def test_general_mask_and_no_bias():
    """A banded (windowed) bool attn_mask through ``allowed``, no bias, d_v != d_h."""
    b, h, t, dh = 2, 2, 11, 4
    q, k, v, bias, valid, _ = inputs(b, h, t, dh, False, pad=2, seed=3, dv=3)
    i = torch.arange(t)
    blocked = (i[:, None] - i[None, :]).abs() > 2
    allowed = build_allowed(valid, True, blocked)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    got = blockwise_attention(*leaves, allowed, None, 0.0, 4)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference(*ref_leaves, allowed, None)
    assert max_diff(got, ref) < 1e-12
    w = [torch.randn_like(r) for r in ref]
    grads = torch.autograd.grad(weighted_sum(got, w), leaves)
    grads_ref = torch.autograd.grad(weighted_sum(ref, w), ref_leaves)
    assert max_diff(grads, grads_ref) < 1e-12


@pytest.mark.parametrize("block", [16, 48])
def test_float32_tolerance(block):
    """float32 at T = 100 against the float64 reference: within 1e-5 (values) and
    1e-4 (gradients), the same order as the float32 reference itself."""
    b, h, t, dh = 2, 2, 100, 16
    q, k, v, bias, valid, allowed = inputs(b, h, t, dh, True, pad=30, seed=7)
    leaves = [x.float().requires_grad_() for x in (q, k, v, bias)]
    got = blockwise_attention(
        *leaves[:3], None, leaves[3], 0.0, block, key_valid=valid, is_causal=True
    )
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    ref = reference(*ref_leaves[:3], allowed, ref_leaves[3])
    assert all(x.dtype == torch.float32 for x in got)
    assert max_diff(got, ref) < 1e-5
    w = [torch.randn_like(r) for r in ref]
    grads = torch.autograd.grad(weighted_sum(got, [x.float() for x in w]), leaves)
    grads_ref = torch.autograd.grad(weighted_sum(ref, w), ref_leaves)
    assert max_diff(grads, grads_ref) < 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_output_is_the_reference_with_the_same_mask(causal):
    """With dropout the output is sum_j p_j m_j f v_j for the hash mask m; the
    statistics are those without dropout; gradients too, for any block size."""
    b, h, t, dh, p_drop = 2, 2, 12, 4, 0.3
    q, k, v, bias, valid, allowed = inputs(b, h, t, dh, causal, pad=3, seed=11)
    seed = _drawn_seed(5)
    keep = full_keep_mask(seed, b, h, t, t, p_drop)
    _, factor = keep_threshold(p_drop)
    for block in (5, 12):

        def call(q, k, v, bias, block=block):
            torch.manual_seed(5)
            return blockwise_attention(q, k, v, allowed, bias, p_drop, block)

        _compare(q, k, v, bias, allowed, call, atol=1e-12, keep=keep, factor=factor)


def test_dropout_mask_rate_and_scale():
    """The keep rate is within 2^-17 of 1 - p in expectation (here within sampling
    error over ~10^6 draws); the multiplier has mean 1; seeds give other masks."""
    p_drop = 0.2
    keep = full_keep_mask(123, 4, 4, 256, 256, p_drop)
    n, factor = keep_threshold(p_drop)
    rate = keep.double().mean().item()
    assert abs(rate - n / 2**16) < 4 * (0.16 / keep.numel()) ** 0.5
    assert abs(rate * factor - 1.0) < 3e-3
    other = full_keep_mask(124, 4, 4, 256, 256, p_drop)
    agree = (keep == other).double().mean().item()
    assert abs(agree - (0.8**2 + 0.2**2)) < 5e-3  # independent masks agree by chance only
    # rows and columns carry no pattern: per-row rates stay near 1 - p
    rows = keep.double().mean(dim=-1)
    assert (rows - 0.8).abs().max() < 0.15


def test_gradcheck_float64_with_dropout_and_bias():
    b, h, t, dh = 2, 1, 5, 2
    q, k, v, bias, valid, allowed = inputs(b, h, t, dh, True, pad=2, seed=2)
    leaves = tuple(x.clone().requires_grad_() for x in (q, k, v, bias))
    for p_drop in (0.0, 0.4):

        def fn(q, k, v, bias, p_drop=p_drop):
            torch.manual_seed(3)  # the same dropout mask at every evaluation
            return blockwise_attention(q, k, v, allowed, bias, p_drop, 3)

        assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def test_no_key_anywhere_and_single_key():
    """A sequence with no valid key gives zeros and zero gradients (no NaN); one key
    gives p = 1: the estimate is that value, sum p^2 = 1."""
    b, h, t, dh = 2, 2, 5, 3
    q, k, v, bias, _, _ = inputs(b, h, t, dh, False, pad=0, seed=4)
    valid = torch.zeros(b, t, dtype=torch.bool)
    valid[1, 2] = True
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    out, est, m2, psq = blockwise_attention(*leaves[:3], None, leaves[3], 0.0, 2, key_valid=valid)
    assert torch.equal(est[0], torch.zeros_like(est[0])) and torch.equal(psq[0], psq[0] * 0)
    torch.testing.assert_close(est[1], v[1, :, 2:3].expand(h, t, dh))
    torch.testing.assert_close(psq[1], torch.ones(h, t, dtype=psq.dtype))
    torch.testing.assert_close(m2[1], v[1, :, 2].square().mean(-1, keepdim=True).expand(h, t))
    grads = torch.autograd.grad((out.sum() + m2.sum() + psq.sum()), leaves)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][0], torch.zeros_like(grads[0][0]))


def test_half_inputs_give_float32_statistics():
    b, h, t, dh = 2, 2, 9, 8
    q, k, v, bias, valid, allowed = inputs(b, h, t, dh, True, pad=2, seed=6)
    qh, kh, vh = (x.bfloat16() for x in (q, k, v))
    got = blockwise_attention(qh, kh, vh, allowed, bias.float(), 0.0, 4)
    assert all(x.dtype == torch.float32 for x in got)
    ref = reference(qh.double(), kh.double(), vh.double(), allowed, bias.float().double())
    assert max_diff(got, ref) < 1e-5


def test_saves_no_quadratic_tensor():
    """Memory stays O(T (block + d)): nothing autograd saves has a (T x S) size."""
    b, h, t, dh = 1, 1, 96, 4
    q, k, v, bias, valid, allowed = inputs(b, h, t, dh, True, pad=0, seed=8, dtype=torch.float32)
    sizes: list[int] = []

    def pack(x):
        if x.dtype.is_floating_point:  # the bool mask is an input, held by the caller
            sizes.append(x.numel())
        return x

    leaves = [x.requires_grad_() for x in (q, k, v, bias)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        outs = blockwise_attention(*leaves[:3], None, leaves[3], 0.1, 16, key_valid=valid)
    assert sizes and max(sizes) <= t * dh
    torch.autograd.grad(sum(o.sum() for o in outs), leaves)


def test_forward_and_backward_functions_match_autograd_of_reference_without_a_mask():
    """The raw functions (no masks at all, the op's inputs as the dispatch passes them)."""
    b, h, t, dh = 1, 2, 7, 4
    q, k, v, bias, _, _ = inputs(b, h, t, dh, False, pad=0, seed=9)
    est, m2, psq, lse, out = blockwise_forward(q, k, v, bias, None, None, None, False, 0.0, 3)
    assert out.numel() == 0
    scores = q @ k.transpose(-1, -2) / dh**0.5 + bias[:, :, None]
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))
    g = [torch.randn_like(x) for x in (est, m2, psq)]
    dq, dk, dv, db = blockwise_backward(
        q, k, v, bias, None, None, None, est, m2, psq, lse, out, *g, None, False, 0.0, 3
    )
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    allowed = torch.ones(b, 1, t, t, dtype=torch.bool)
    ref = reference(*leaves[:3], allowed, leaves[3])[1:]
    expected = torch.autograd.grad(weighted_sum(ref, g), leaves)
    assert max_diff((dq, dk, dv, db), expected) < 1e-12


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"q": torch.zeros(2, 3, 4)}, "must be \\(B, H, T, d\\)"),
        ({"k": torch.zeros(1, 2, 5, 3)}, "k must be"),
        ({"bias": torch.zeros(1, 2, 4)}, "bias must be"),
        ({"allowed": torch.ones(1, 1, 5, 4)}, "allowed must be a bool"),
        ({"key_valid": torch.ones(1, 4)}, "key_valid must be a bool"),
        ({"dropout_p": 1.0}, "dropout_p must be in"),
        ({"block_size": 0}, "block_size must be"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, match):
    args = {
        "q": torch.zeros(1, 2, 5, 4),
        "k": torch.zeros(1, 2, 5, 4),
        "v": torch.zeros(1, 2, 5, 4),
        "allowed": None,
        "bias": torch.zeros(1, 2, 5),
        "dropout_p": 0.0,
        "block_size": 4,
    }
    extra = {}
    if "key_valid" in kwargs:
        extra["key_valid"] = kwargs.pop("key_valid")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        blockwise_attention(**args, **extra)


def _compiled_matches_eager(backend: str) -> None:
    b, h, t, dh = 2, 2, 10, 4
    q, k, v, bias, valid, allowed = inputs(b, h, t, dh, True, pad=3, seed=10, dtype=torch.float32)

    def loss(q, k, v, bias):
        outs = blockwise_attention(q, k, v, None, bias, 0.0, 4, key_valid=valid, is_causal=True)
        return outs[0].square().sum() + outs[2].sum() + outs[3].sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    eager = loss(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(loss, fullgraph=True, backend=backend)(*leaves)
    grads = torch.autograd.grad(compiled, leaves)
    torch.testing.assert_close(compiled, eager)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_compiled_fullgraph_equals_eager():
    """torch.compile(fullgraph=True) traces the custom op, forward and backward
    (dynamo and AOTAutograd: the fake implementation and the registered backward)."""
    _compiled_matches_eager("aot_eager")


@pytest.mark.slow
def test_compiled_fullgraph_inductor_equals_eager():
    """The same through inductor (C++ code generation on a CPU: about a minute)."""
    _compiled_matches_eager("inductor")


def test_compiled_with_dropout_and_dynamic_lengths():
    """Dropout compiles in one graph (the seed is a tensor drawn inside it), and a
    second sequence length reuses a dynamic graph instead of recompiling per length."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def loss(q, k, v, valid):
        outs = blockwise_attention(q, k, v, None, None, 0.2, 4, key_valid=valid, is_causal=True)
        return sum(o.sum() for o in outs)

    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend=counter)
    torch._dynamo.reset()
    for t in (9, 14, 17):
        q, k, v, _, valid, _ = inputs(2, 2, t, 4, True, pad=2, seed=t, dtype=torch.float32)
        leaves = [x.requires_grad_() for x in (q, k, v)]
        grads = torch.autograd.grad(compiled(*leaves, valid), leaves)
        assert all(torch.isfinite(g).all() for g in grads)
    assert counter.frame_count == 1


@pytest.mark.parametrize("impl", ["blockwise", "fused"])
def test_a_layer_with_the_kernel_equals_the_chunked_layer(impl):
    """Through the dispatch (``attention_impl``): a BFT encoder layer with the
    kernel gives the chunked layer's output, precision and gradients (float64,
    padding, causal). On a CPU tensor "fused" runs the blockwise algorithm."""
    from bft_lightning.nn import BFTEncoderLayer

    torch.manual_seed(0)
    layer = BFTEncoderLayer(16, 2, 32, dropout=0.0, precision="on", attention_impl="chunked")
    layer = layer.double().eval()  # eval: the running sill stays as it is between the runs
    other = BFTEncoderLayer(16, 2, 32, dropout=0.0, precision="on", attention_impl=impl)
    other = other.double().eval()
    other.load_state_dict(layer.state_dict())
    h = torch.randn(3, 23, 16, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(3, 23, dtype=torch.bool)
    pad[0, :9] = True

    def run(m):
        y, lp = m(h, None, key_padding_mask=pad, is_causal=True)
        loss = (y * torch.cos(y)).sum() + lp[~pad].sum()
        return loss, torch.autograd.grad(loss, [h, *m.parameters()])

    loss, grads = run(layer)
    loss_k, grads_k = run(other)
    torch.testing.assert_close(loss_k, loss, rtol=0, atol=1e-10)
    assert max_diff(grads_k, grads) < 1e-10
