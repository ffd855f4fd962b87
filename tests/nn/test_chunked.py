"""The chunked (memory-bounded) attention path against the materialised reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bft_lightning.nn.attention import build_allowed
from bft_lightning.nn.kernels.chunked import _ChunkedKriging, chunked_attention
from bft_lightning.nn.kernels.chunks import _MASK_LEVELS, _keep_bits
from bft_lightning.nn.kernels.reference import reference_attention
from bft_lightning.nn.layers import BFTEncoderLayer


def _inputs(b, h, t, dh, causal, pad, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, dh, generator=g, dtype=dtype) for _ in range(3))
    bias = torch.randn(b, h, t, generator=g, dtype=dtype)
    valid = torch.ones(b, t, dtype=torch.bool)
    if pad:
        valid[0, :pad] = False  # left padding; with causal, the first rows have no key
    if b > 1:
        valid[-1] = False  # a sequence with no valid key at all
        valid[-1, -1] = True
    allowed = build_allowed(valid, causal)
    return q, k, v, bias, allowed


def _all_outputs(fn, q, k, v, bias):
    out, estimate, second, sum_p_sq = fn(q, k, v, bias)
    return torch.cat([out.flatten(), estimate.flatten(), second.flatten(), sum_p_sq.flatten()])


def _reference(allowed):
    def fn(q, k, v, bias):
        out, _, st_ = reference_attention(q, k, v, allowed, bias, 0.0, True)
        return out, st_.estimate, st_.second_moment, st_.sum_p_sq

    return fn


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    t=st.integers(1, 12),
    dh=st.sampled_from([1, 4, 8]),
    causal=st.booleans(),
    pad=st.integers(0, 5),
    chunk=st.integers(1, 7),
    seed=st.integers(0, 10_000),
)
def test_values_and_gradients_equal_reference(b, h, t, dh, causal, pad, chunk, seed):
    q, k, v, bias, allowed = _inputs(b, h, t, dh, causal, min(pad, t - 1), seed)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    leaves_ref = [x.clone().requires_grad_() for x in (q, k, v, bias)]

    def chunked(q, k, v, bias):
        return chunked_attention(q, k, v, allowed, bias, 0.0, chunk)

    got = _all_outputs(chunked, *leaves)
    want = _all_outputs(_reference(allowed), *leaves_ref)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    weights = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad((got * weights).sum(), leaves)
    grads_ref = torch.autograd.grad((want * weights).sum(), leaves_ref)
    for name, a, r in zip("qkvb", grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-10, msg=f"grad of {name}")


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize(("chunk", "keep"), [(4, False), (8, False), (8, True)])
def test_gradcheck_with_dropout(dropout, chunk, keep):
    """The backward regenerates (or keeps) the forward's dropout mask: gradcheck passes."""
    q, k, v, bias, allowed = _inputs(2, 2, 6, 3, True, 2, 0)
    args = [x.requires_grad_() for x in (q, k, v, bias)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: _ChunkedKriging.apply(q, k, v, b, allowed, dropout, chunk, 1234, keep),
        args,
    )


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_kept_weights_equal_recomputed(dropout):
    """One block: keeping the weights and mask for the backward changes nothing but time."""
    q, k, v, bias, allowed = _inputs(2, 2, 12, 4, True, 3, 1)
    results = []
    for keep in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        outs = _ChunkedKriging.apply(*leaves, allowed, dropout, 16, 99, keep)
        sum(o.square().sum() * (i + 1) for i, o in enumerate(outs)).backward()
        results.append([*outs, *(x.grad for x in leaves)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _keep_mask(p, dropout, seed, index):
    """The dropout multiplier ``m / keep`` the chunked path applies to a block."""
    bits, factor = _keep_bits(p, dropout, seed, index)
    return bits.to(p.dtype) * factor


@pytest.mark.parametrize("dropout", [0.1, 0.5, 0.9])
def test_keep_mask_rate_scale_and_lanes(dropout):
    """Four 16-bit uniforms per 64-bit draw: every lane keeps at the right rate,
    the multiplier's mean is 1, the mask repeats per seed and block only."""
    p = torch.empty(4, 2, 100, 250)  # 200,000 weights: 50,000 of each lane
    mask = _keep_mask(p, dropout, seed=7, index=3)
    n = round((1 - dropout) * _MASK_LEVELS)
    kept = mask > 0
    assert set(mask.unique().tolist()) <= {0.0, torch.tensor(_MASK_LEVELS / n).item()}
    lanes = kept.flatten()[: (kept.numel() // 4) * 4].view(-1, 4).double().mean(0)
    sd = ((1 - dropout) * dropout / (kept.numel() / 4)) ** 0.5
    assert ((lanes - (1 - dropout)).abs() < 5 * sd).all(), lanes  # a lane with a fixed bit fails
    assert abs(mask.double().mean().item() - 1.0) < 5 * sd / (1 - dropout)
    flat = kept.flatten().double()
    corr = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]
    assert corr.abs() < 0.02  # neighbours (same 64-bit draw) independent
    torch.testing.assert_close(_keep_mask(p, dropout, 7, 3), mask)
    assert not torch.equal(_keep_mask(p, dropout, 7, 4), mask)
    assert (_keep_mask(p, 1.0, 7, 3) == 0).all()
    assert (_keep_mask(p, 1e-6, 7, 3) == 1).all()  # keep rounds to 1: all kept, factor 1


def test_dropout_drops_output_not_statistics():
    q, k, v, bias, allowed = _inputs(2, 2, 16, 4, True, 0, 1)
    torch.manual_seed(0)
    out, estimate, second, sum_p_sq = chunked_attention(q, k, v, allowed, bias, 0.5, 5)
    _, _, ref = reference_attention(q, k, v, allowed, bias, 0.0, True)
    torch.testing.assert_close(estimate, ref.estimate)
    torch.testing.assert_close(sum_p_sq, ref.sum_p_sq)
    assert not torch.allclose(out, estimate)  # the output saw dropout
    # unbiased: averaged over many masks the dropped output approaches the estimate
    torch.manual_seed(1)
    mean = torch.stack(
        [chunked_attention(q, k, v, allowed, bias, 0.5, 5)[0] for _ in range(400)]
    ).mean(0)
    assert (mean - estimate).abs().max() < 0.25
    assert (mean - estimate).abs().mean() < 0.03


@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gain", ["group", "head"])
def test_layer_chunked_equals_reference(groups, causal, gain):
    """A whole BFT layer (train mode, running sill, padding): outputs and all grads agree."""
    torch.manual_seed(0)
    opts = dict(dropout=0.0, groups=groups, gain=gain)
    ref = BFTEncoderLayer(8, 2, 16, attention_impl="reference", **opts)
    chk = BFTEncoderLayer(8, 2, 16, attention_impl="chunked", attention_chunk=3, **opts)
    chk.load_state_dict(ref.state_dict())
    h = torch.randn(3, 10, 8)
    log_prec = torch.randn(3, 10, groups)
    log_prec[0, :4] = float("-inf")  # padding
    outs = []
    for layer in (ref, chk):
        x = h.clone().requires_grad_()
        y, lp = layer(x, log_prec, is_causal=causal)
        (y.square().sum() + lp[torch.isfinite(lp)].sum()).backward()
        layer.flush_sill()
        outs.append((y, lp, x.grad, [p.grad for p in layer.parameters()], layer.sill.clone()))
    (y0, lp0, g0, pg0, s0), (y1, lp1, g1, pg1, s1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lp1, lp0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s1, s0)
    for a, r in zip(pg1, pg0, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-3, atol=1e-5)


def test_off_twin_with_chunked_uses_fused_kernel_and_matches():
    torch.manual_seed(0)
    ref = BFTEncoderLayer(8, 2, 16, dropout=0.0, precision="off")
    chk = BFTEncoderLayer(8, 2, 16, dropout=0.0, precision="off", attention_impl="chunked")
    chk.load_state_dict(ref.state_dict())
    h = torch.randn(2, 7, 8)
    lp = torch.zeros(2, 7, 2)
    lp[1, :3] = float("-inf")
    torch.testing.assert_close(chk(h, lp, is_causal=True)[0], ref(h, lp, is_causal=True)[0])


def test_chunk_size_validated():
    with pytest.raises(ValueError, match="attention_chunk"):
        BFTEncoderLayer(8, 2, 16, attention_impl="chunked", attention_chunk=0)
    with pytest.raises(ValueError, match="impl"):
        BFTEncoderLayer(8, 2, 16, attention_impl="flash")


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_statistics_stay_float32_under_bf16_autocast(impl):
    """Spec section 1: the spread is a difference of two large numbers; it is
    accumulated in float32 even when the model runs under bf16 autocast."""
    from bft_lightning.nn.attention import KrigingAttention

    torch.manual_seed(0)
    attn = KrigingAttention(16, 2, impl=impl, chunk_size=4)
    x = torch.randn(2, 9, 16) * 3 + 5  # large common mean: S is a small difference
    allowed = build_allowed(torch.ones(2, 9, dtype=torch.bool), True)
    bias = torch.randn(2, 2, 9)
    _, _, want, _ = attn(x, allowed, bias, with_stats=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, got, _ = attn(x, allowed, bias, with_stats=True)
    for name in ("estimate", "second_moment", "sum_p_sq"):
        assert getattr(got, name).dtype == torch.float32, name
    spread = lambda st_: st_.second_moment - st_.estimate.square().mean(-1)  # noqa: E731
    # bf16 only in the input projection: the spread stays within a few percent
    err = (spread(got) - spread(want)).abs().mean() / spread(want).abs().mean()
    assert err < 0.05


def test_keys_differ_from_queries():
    """S != T (e.g. cached keys): values and gradients equal the reference."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(2, 2, 7, generator=g, dtype=torch.float64)
    allowed = torch.rand(2, 1, 5, 7, generator=g) < 0.6
    allowed[0, 0, 1] = False  # a row with no key
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    leaves_ref = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    got = _all_outputs(lambda *a: chunked_attention(*a[:3], allowed, a[3], 0.0, 2), *leaves)
    want = _all_outputs(_reference(allowed), *leaves_ref)
    torch.testing.assert_close(got, want)
    for a, r in zip(
        torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves_ref)
    ):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_recommender_under_autocast_runs_and_is_finite(dtype):
    """The default (chunked) on-model under mixed precision: bias, masks and
    dropout in the right dtypes; finite loss and gradients."""
    from bft_lightning.models import SASRec

    torch.manual_seed(0)
    model = SASRec(30, max_len=12, d_model=16, nhead=2, num_layers=2, precision="on").train()
    ids = torch.randint(1, 31, (3, 12))
    ids[0, :9] = 0
    with torch.autocast("cpu", dtype=dtype):
        hidden, log_prec = model.encode(ids)
        loss = model.score(hidden[:, -1]).float().logsumexp(-1).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_layer_with_dropout_trains_like_the_reference():
    """With attention dropout the two paths draw different masks, but both are
    unbiased: over many steps the mean output agrees."""
    torch.manual_seed(0)
    ref = BFTEncoderLayer(8, 2, 16, dropout=0.3, attention_impl="reference")
    chk = BFTEncoderLayer(8, 2, 16, dropout=0.3, attention_impl="chunked", attention_chunk=3)
    chk.load_state_dict(ref.state_dict())
    h = torch.randn(2, 6, 8)
    lp = torch.zeros(2, 6, 2)
    means = []
    for layer in (ref, chk):
        layer.sill_momentum = 0.0  # a fixed sill: only the dropout masks vary
        torch.manual_seed(1)
        means.append(torch.stack([layer(h, lp, is_causal=True)[0] for _ in range(300)]).mean(0))
    assert (means[0] - means[1]).abs().mean() < 0.05


def test_key_spans_trim_causal_blocks_and_left_padding():
    """Each query block reads only keys up to its last row (causal) and from the
    first key any of its rows may read (left padding); an all-padding block
    is skipped."""
    from bft_lightning.nn.kernels.chunks import _key_spans

    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[:, :4] = False  # both sequences start at position 4
    spans = _key_spans(build_allowed(valid, is_causal=True), chunk=3)
    assert spans == [(0, 3, 0, 0), (3, 6, 4, 6), (6, 9, 4, 9), (9, 10, 4, 10)]
    valid[1, :] = True  # one sequence without padding widens every span
    spans = _key_spans(build_allowed(valid, is_causal=True), chunk=3)
    assert spans == [(0, 3, 0, 3), (3, 6, 0, 6), (6, 9, 0, 9), (9, 10, 0, 10)]
    assert _key_spans(build_allowed(valid, is_causal=False), chunk=4)[0] == (0, 4, 0, 10)


@pytest.mark.parametrize(("t", "s"), [(0, 3), (3, 0)])
def test_empty_queries_or_keys_give_empty_or_zero_outputs(t, s):
    q = torch.randn(1, 2, t, 4)
    k, v = torch.randn(1, 2, s, 4), torch.randn(1, 2, s, 4)
    allowed = torch.ones(1, 1, t, s, dtype=torch.bool)
    outs = chunked_attention(q, k, v, allowed, torch.zeros(1, 2, s), 0.0, 2)
    assert [tuple(o.shape) for o in outs] == [(1, 2, t, 4), (1, 2, t, 4), (1, 2, t), (1, 2, t)]
    assert all(not o.any() for o in outs)


@settings(max_examples=15, deadline=None)
@given(
    t=st.integers(2, 12),
    window=st.integers(1, 6),
    chunk=st.integers(1, 5),
    dropout=st.sampled_from([0.0, 0.4]),
    seed=st.integers(0, 10_000),
)
def test_banded_masks_equal_reference(t, window, chunk, dropout, seed):
    """Sliding-window (banded) masks: blocks read a key span that starts past 0;
    values, gradients and the dropout mask's replay stay exact."""
    g = torch.Generator().manual_seed(seed)
    b, h, dh = (1, 1, 2) if dropout > 0 else (2, 2, 3)  # gradcheck: few inputs to perturb
    q, k, v = (torch.randn(b, h, t, dh, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(b, h, t, generator=g, dtype=torch.float64)
    i = torch.arange(t)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    allowed = band.expand(b, 1, t, t)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    if dropout > 0:  # the hand-written backward against finite differences
        assert torch.autograd.gradcheck(
            lambda q, k, v, b: _ChunkedKriging.apply(
                q, k, v, b, allowed, dropout, chunk, seed, False
            ),
            leaves,
        )
        return
    leaves_ref = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    got = _all_outputs(lambda *a: chunked_attention(*a[:3], allowed, a[3], 0.0, chunk), *leaves)
    want = _all_outputs(_reference(allowed), *leaves_ref)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    for a, r in zip(
        torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves_ref)
    ):
        torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-10)


def test_direct_call_under_autocast_recomputes_and_backpropagates():
    """Kept weights would be bf16 against float32 gradients: under autocast the
    one-block call recomputes instead, and its backward runs."""
    q, k, v, bias, allowed = _inputs(2, 2, 8, 4, True, 2, 3, dtype=torch.float32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_attention(*leaves[:3], allowed, leaves[3], 0.2, 16, keep_weights=True)
    sum(o.float().square().sum() for o in out).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("bias_scale", [1.0, 20.0])
def test_gradients_under_autocast_are_the_float32_ones(bias_scale):
    """Under autocast the forward's products are bf16 but the backward recomputes the
    weights in float32: its row sums must come from that recomputation too (not from
    the bf16 outputs), so that with a loss linear in the outputs the gradients are
    the float32 ones, also with a large bias (near one-hot rows)."""
    q, k, v, bias, allowed = _inputs(2, 2, 24, 4, True, 3, 4, dtype=torch.float32)
    bias = bias * bias_scale

    def grads(autocast: bool) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = chunked_attention(*leaves[:3], allowed, leaves[3], 0.0, 8)
        (out[1].float().sum() + out[2].float().sum() + out[3].float().sum()).backward()
        return [x.grad for x in leaves]

    for got, want in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_reduced_precision_matmul_mode_keeps_values_and_gradients(dropout):
    """With ``torch.set_float32_matmul_precision("high")`` (TF32 on CUDA) the bias is
    added in the product's accumulator and the row sums come from the recomputed
    weights: that path too equals the reference (float64 here, where the mode changes
    no arithmetic) and passes gradcheck with dropout."""
    q, k, v, bias, allowed = _inputs(2, 2, 10, 3, True, 3, 6)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        if dropout > 0:
            assert torch.autograd.gradcheck(
                lambda q, k, v, b: _ChunkedKriging.apply(q, k, v, b, allowed, dropout, 4, 7, False),
                leaves,
            )
            return
        leaves_ref = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        got = _all_outputs(lambda *a: chunked_attention(*a[:3], allowed, a[3], 0.0, 4), *leaves)
        want = _all_outputs(_reference(allowed), *leaves_ref)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        weights = torch.randn(got.shape, dtype=got.dtype)
        for a, r in zip(
            torch.autograd.grad((got * weights).sum(), leaves),
            torch.autograd.grad((want * weights).sum(), leaves_ref),
            strict=True,
        ):
            torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-10)
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    ("backend", "value"),
    [("cuda", "tf32"), ("mkldnn", "bf16"), ("cuda", "ieee")],
)
def test_newer_per_backend_precision_settings_are_read(backend, value):
    """``torch.backends.<backend>.matmul.fp32_precision`` (PyTorch's newer API) makes
    the legacy ``get_float32_matmul_precision`` raise: the call still runs, takes the
    full-precision shortcuts only where the device's own backend is IEEE, and equals
    the reference (float64 here)."""
    from bft_lightning.nn.kernels.chunks import _full_precision_matmul

    settings = getattr(torch.backends, backend).matmul
    before = settings.fp32_precision
    q, k, v, bias, allowed = _inputs(2, 2, 9, 3, True, 2, 8)
    try:
        settings.fp32_precision = value
        expect_cpu = not (backend == "mkldnn" and value != "ieee")
        assert _full_precision_matmul("cpu") == expect_cpu
        assert _full_precision_matmul("cuda") == (backend != "cuda" or value == "ieee")
        leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        leaves_ref = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        got = _all_outputs(lambda *a: chunked_attention(*a[:3], allowed, a[3], 0.0, 4), *leaves)
        want = _all_outputs(_reference(allowed), *leaves_ref)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        got.sum().backward()
        want.sum().backward()
        for a, r in zip(leaves, leaves_ref, strict=True):
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-8, atol=1e-10)
    finally:
        settings.fp32_precision = before
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("chunk", [4, 16])
def test_projection_views_in_heads_merge_as_views(dropout, chunk):
    """q, k, v as the layer passes them (transposed views of one projection) give the
    values and gradients of contiguous copies; the output and the gradients come
    back laid out heads last, so merging the heads into (B, T, H d_h) is a view."""
    b, h, t, dh = 2, 3, 12, 4
    g = torch.Generator().manual_seed(5)
    proj = torch.randn(b, t, 3 * h * dh, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(b, h, t, generator=g, dtype=torch.float64)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :3] = False
    allowed = build_allowed(valid, True)

    def run(make_contiguous):
        q, k, v = (y.view(b, t, h, dh).transpose(1, 2) for y in proj.chunk(3, dim=-1))
        if make_contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        torch.manual_seed(0)  # the same dropout seed for both calls
        out, e, m, sp = chunked_attention(q, k, v, allowed, bias, dropout, chunk)
        assert out.transpose(1, 2).is_contiguous()
        leaves = (q, k, v)
        grads = torch.autograd.grad(
            out.square().sum() + e.sum() + m.sum() + sp.sum(), leaves, retain_graph=True
        )
        return [out, e, m, sp], grads

    outs_view, grads_view = run(False)
    outs_cont, grads_cont = run(True)
    for a, r in zip(outs_view, outs_cont, strict=True):
        torch.testing.assert_close(a, r, rtol=0, atol=0)
    for a, r in zip(grads_view, grads_cont, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
        assert a.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_block_mask_equals_a_fill_of_the_blocked_scores(dtype):
    """The additive mask (float32 / float64) gives bit for bit the weights of a fill
    with the blocked value, also for large scores and rows with no key (uniform
    weights, has_key 0); half types take the fill itself."""
    from bft_lightning.nn.kernels.chunks import _block
    from bft_lightning.nn.kernels.reference import masked_value

    q, k, _, bias, allowed = _inputs(3, 2, 9, 4, True, 3, seed=1, dtype=dtype)
    q = q * 1e6  # scores up to ~1e13: s - 1e30 must still round to -1e30
    qs = q.contiguous()
    kt = k.transpose(-1, -2).contiguous().reshape(6, 4, 9)
    p, has_key, _ = _block(qs, kt, allowed, (0, 9, 0, 9), bias)
    scores = torch.baddbmm(bias.reshape(6, 1, 9), qs.reshape(6, 9, 4), kt).view(3, 2, 9, 9)
    want = torch.softmax(scores.masked_fill(~allowed, masked_value(dtype)), dim=-1)
    assert torch.equal(p, want)
    assert torch.equal(has_key, allowed.any(-1, keepdim=True).to(dtype))
    assert (has_key == 0).any()  # rows with no key were exercised
