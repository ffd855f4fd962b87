"""The fused Triton kernel against the reference, on a CPU under ``TRITON_INTERPRET=1``.

The interpreter runs the kernels' Python one block at a time, so the shapes
are small; the same comparison on CUDA tensors is in ``bench/cuda_fast_path.py``.
Triton's interpreter mode is fixed when ``triton`` is first imported, and
``torch._dynamo`` imports it (in compiled mode) on its own import: the
``conftest.py`` of this folder imports it interpreted first when this folder is
collected on its own; in a whole-suite run set ``TRITON_INTERPRET=1`` in the
environment (CI: ``TRITON_INTERPRET=1 pytest tests/nn/kernels``), else these
tests skip and say so.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import inputs, max_diff, reference, weighted_sum

from bft_lightning.nn.attention import build_allowed
from bft_lightning.nn.kernels import fused_triton
from bft_lightning.nn.kernels.blockwise import blockwise_attention
from bft_lightning.nn.kernels.fused_triton import fused_kriging_attention, triton_available

needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="triton is not installed (optional extra: pip install 'bft-lightning[triton]'); "
    "these tests run its kernels under TRITON_INTERPRET=1",
)


@pytest.fixture
def interpret(monkeypatch):
    """CPU calls run the Triton kernels under the interpreter for this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not fused_triton.uses_triton(torch.zeros(1)):
        pytest.skip(
            "Triton was imported in compiled mode before these tests (its mode is fixed "
            "at import); run them as `TRITON_INTERPRET=1 pytest tests/nn/kernels`"
        )


def _check(q, k, v, bias, allowed, call, atol, grad_atol):
    has_bias = bias is not None
    leaves = [x.clone().requires_grad_() for x in (q, k, v) + ((bias,) if has_bias else ())]
    ref_leaves = [x.double().requires_grad_() for x in leaves]
    got = call(*leaves)
    ref = reference(*ref_leaves[:3], allowed, ref_leaves[3] if has_bias else None)
    assert max_diff(got, ref) < atol
    g = torch.Generator().manual_seed(2)
    w = [torch.randn(r.shape, generator=g, dtype=torch.float64) for r in ref]
    grads = torch.autograd.grad(weighted_sum(got, [x.to(q.dtype) for x in w]), leaves)
    grads_ref = torch.autograd.grad(weighted_sum(ref, w), ref_leaves)
    assert max_diff(grads, grads_ref) < grad_atol


@needs_triton
@pytest.mark.parametrize(
    "causal, masks", [(False, "allowed"), (True, "allowed"), (True, "key_valid")]
)
def test_triton_equals_reference(interpret, causal, masks):
    """float32, T = 21 over blocks of 16 (the last one partial), left padding, a
    sequence with no key and one with a single key, a bias."""
    b, h, t, dh = 3, 1, 21, 8
    q, k, v, bias, valid, allowed = inputs(b, h, t, dh, causal, pad=5, seed=1, dtype=torch.float32)

    def call(q, k, v, bias):
        if masks == "allowed":
            return fused_kriging_attention(q, k, v, allowed, bias, 0.0, 16)
        return fused_kriging_attention(
            q, k, v, None, bias, 0.0, 16, key_valid=valid, is_causal=causal
        )

    _check(q, k, v, bias, allowed, call, atol=1e-5, grad_atol=5e-5)


@needs_triton
def test_triton_float64_band_mask_no_bias_other_value_width(interpret):
    """float64 (tight), a banded attn_mask, no bias, d_v = 3 != d_h = 5 (both padded
    to the kernels' power-of-two widths)."""
    b, h, t = 1, 1, 20
    q, k, v, _, valid, _ = inputs(b, h, t, 5, False, pad=3, seed=4, dv=3)
    i = torch.arange(t)
    allowed = build_allowed(valid, True, (i[:, None] - i[None, :]) > 6)
    _check(
        q, k, v, None, allowed,
        lambda q, k, v: fused_kriging_attention(q, k, v, allowed, None, 0.0, 16),
        atol=1e-12, grad_atol=1e-11,
    )  # fmt: skip


@needs_triton
def test_triton_dropout_equals_blockwise(interpret):
    """The same hash mask as the blockwise version: same output and gradients."""
    b, h, t, dh, p_drop = 2, 1, 21, 4, 0.25
    q, k, v, bias, valid, _ = inputs(b, h, t, dh, True, pad=4, seed=3, dtype=torch.float32)
    results = []
    for fn, block in ((fused_kriging_attention, 16), (blockwise_attention, 7)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        torch.manual_seed(9)
        outs = fn(*leaves[:3], None, leaves[3], p_drop, block, key_valid=valid, is_causal=True)
        w = [torch.ones_like(o) * (i + 1) for i, o in enumerate(outs)]
        results.append((outs, torch.autograd.grad(weighted_sum(outs, w), leaves)))
    (outs, grads), (outs_b, grads_b) = results
    assert not torch.allclose(outs[0], outs[1])  # dropout acted on the output only
    assert max_diff(outs, outs_b) < 1e-5
    assert max_diff(grads, grads_b) < 5e-5


@pytest.mark.slow
@needs_triton
def test_triton_op_compiles_fullgraph(interpret):
    """The custom op traces in one graph, forward and backward, and agrees with eager
    (the interpreter runs inside the traced graph: ~20 s)."""
    b, h, t, dh = 1, 1, 12, 4
    q, k, v, bias, valid, _ = inputs(b, h, t, dh, True, pad=3, seed=5, dtype=torch.float32)

    def loss(q, k, v, bias):
        outs = fused_kriging_attention(q, k, v, None, bias, 0.0, 16, key_valid=valid,
                                       is_causal=True)  # fmt: skip
        return outs[1].square().sum() + outs[2].sum() + outs[3].sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    eager = loss(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    torch.testing.assert_close(compiled, eager)
    for g, e in zip(torch.autograd.grad(compiled, leaves), eager_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_cpu_without_interpreter_takes_the_blockwise_path(monkeypatch):
    """Without TRITON_INTERPRET (or without Triton) a CPU call runs the blockwise
    version through the same op: the reference's values and gradients."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_triton.uses_triton(torch.zeros(1))
    b, h, t, dh = 2, 2, 15, 4
    q, k, v, bias, valid, allowed = inputs(b, h, t, dh, True, pad=4, seed=6)
    _check(
        q, k, v, bias, allowed,
        lambda q, k, v, bias: fused_kriging_attention(q, k, v, allowed, bias, 0.0, 4),
        atol=1e-12, grad_atol=1e-12,
    )  # fmt: skip
