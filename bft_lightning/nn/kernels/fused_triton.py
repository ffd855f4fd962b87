"""The fused kriging kernel in Triton: one pass over the keys, forward and backward.

The algorithm of ``kernels.blockwise`` (its docstring has the formulas) as three
Triton kernels:

- ``_fwd_kernel``: a program per (query block, batch * head) reads the key
  blocks once with an online softmax and writes the estimate, the second
  moment, ``sum_j p^2``, the log-sum-exp and, with dropout, the output;
- ``_bwd_dkdv_kernel``: a program per (key block, batch * head) recomputes the
  weights of every query block and accumulates dk, dv and d bias;
- ``_bwd_dq_kernel``: a program per (query block, batch * head) accumulates dq.

No (T x S) tensor is stored, and no atomics are used. The row sums
``c = g_e . e + g_M M + 2 g_P P + g_o . o`` are (B, H, T) elementwise products
taken in PyTorch before the backward kernels. The dropout mask is the same
counter-based hash as the blockwise version's (``blockwise.keep_mask``), so the
two give the same numbers with dropout too.

It is registered as the custom op ``bft_lightning::kriging_fused``
(:func:`blockwise.define_kriging_op`: a fake implementation and a registered
backward), so ``torch.compile(fullgraph=True)`` traces through it. Where it
runs: CUDA tensors with Triton installed take the kernels; CPU tensors take
them under Triton's interpreter when ``TRITON_INTERPRET=1`` is set (for tests:
slow) and the blockwise PyTorch version otherwise, which is also the path
without Triton. Triton is an optional dependency: this module imports without it.
"""

import importlib.util
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from bft_lightning.nn.kernels.blockwise import (
    Outputs,
    backward_row_sums,
    blockwise_backward,
    blockwise_forward,
    default_block,
    define_kriging_op,
    prepare,
)
from bft_lightning.nn.kernels.dropout_hash import _GOLDEN, _H1, _H2, _M32, keep_threshold

# Triton is optional (the "triton" extra) and imported on first use only: its
# interpreter mode is fixed when it is imported (TRITON_INTERPRET), and importing
# this module must not fix it
HAVE_TRITON = importlib.util.find_spec("triton") is not None
triton: Any = None
tl: Any = None


def _import_triton() -> None:
    global triton, tl
    if triton is None:
        import triton as triton_module
        import triton.language as tl_module

        triton, tl = triton_module, tl_module


# the hash's constants appear as literals in the kernels (compiled Triton reads no
# plain module globals): they must stay equal to blockwise's
assert (_H1, _H2, _GOLDEN, _M32) == (0x21F0AAAD, 0x735A2D97, 0x9E3779B9, 0xFFFFFFFF)


def triton_available() -> bool:
    """Whether Triton can be imported."""
    return HAVE_TRITON


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET=1`` asks CPU tensors to run the kernels interpreted."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_interpreted() -> bool:
    """Whether Triton is (or, not yet imported, will be) in its interpreter mode:
    the mode is fixed when ``triton`` is first imported, by ``TRITON_INTERPRET``
    then (``torch.compile`` may import it first, in compiled mode)."""
    if not HAVE_TRITON:
        return False
    if "triton" not in sys.modules:
        return interpret_requested()
    _import_triton()
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def uses_triton(x: Tensor) -> bool:
    """Whether a call on ``x`` runs the Triton kernels (else the blockwise version):
    CUDA tensors with Triton installed, and CPU tensors when ``TRITON_INTERPRET=1``
    is set and Triton runs interpreted."""
    if not HAVE_TRITON:
        return False
    if x.device.type == "cuda":
        return True
    return x.device.type == "cpu" and interpret_requested() and triton_interpreted()


_KERNELS: dict[bool, SimpleNamespace] = {}


def _kernels(interpret: bool) -> SimpleNamespace:
    """The three kernels, JIT-compiled or (CPU tensors) wrapped for the interpreter."""
    if interpret not in _KERNELS:
        from bft_lightning.nn.kernels.triton_kernels import define_kernels

        fns = define_kernels()
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction as wrap
        else:
            wrap = triton.jit
        _KERNELS[interpret] = SimpleNamespace(
            fwd=wrap(fns.fwd), dkdv=wrap(fns.dkdv), dq=wrap(fns.dq)
        )
    return _KERNELS[interpret]


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def _launch_args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    allowed: Tensor | None,
    key_valid: Tensor | None,
    seed: Tensor | None,
) -> tuple[list[Any], list[Any]]:
    """The pointer arguments (dummies where absent) and the strides of every input."""
    b = q.shape[0]
    dummy = q
    allowed_u8 = allowed.view(torch.uint8) if allowed is not None else None
    kv_u8 = key_valid.view(torch.uint8) if key_valid is not None else None
    ptrs = [
        q, k, v,
        bias if bias is not None else dummy,
        allowed_u8 if allowed_u8 is not None else dummy,
        kv_u8 if kv_u8 is not None else dummy,
        seed if seed is not None else q.new_zeros(1, dtype=torch.int64),
    ]  # fmt: skip
    strides: list[Any] = [*q.stride(), *k.stride(), *v.stride()]
    strides += [*bias.stride()] if bias is not None else [0, 0, 0]
    if allowed_u8 is not None:
        batch_stride = allowed_u8.stride(0) if allowed_u8.shape[0] == b else 0
        strides += [batch_stride, allowed_u8.stride(2), allowed_u8.stride(3)]
    else:
        strides += [0, 0, 0]
    strides += [*kv_u8.stride()] if kv_u8 is not None else [0, 0]
    return ptrs, strides


def _block_sizes(q: Tensor, v: Tensor, block: int) -> tuple[int, int, int, int]:
    dh, dv = q.shape[-1], v.shape[-1]
    blk = _pow2(block)
    return blk, blk, _pow2(dh), _pow2(dv)


def _scalars(q: Tensor, factor: float) -> Tensor:
    """``[1 / sqrt(d_h), dropout factor]`` in q's dtype on its device (a Python float
    argument would reach a kernel as float32, also in a float64 kernel)."""
    return torch.tensor([q.shape[-1] ** -0.5, factor], dtype=q.dtype, device=q.device)


def _acc_dtype(q: Tensor) -> Any:
    return tl.float64 if q.dtype == torch.float64 else tl.float32


def triton_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    allowed: Tensor | None,
    key_valid: Tensor | None,
    seed: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward as :func:`blockwise.blockwise_forward`, by the Triton kernels
    (the blockwise version where they do not run: :func:`uses_triton`)."""
    if not uses_triton(q):
        return blockwise_forward(q, k, v, bias, allowed, key_valid, seed, is_causal,
                                 dropout_p, block)  # fmt: skip
    b, h, t, dh = q.shape
    s, dv = k.shape[2], v.shape[3]
    est = q.new_empty(b, h, t, dv)
    m2, psq, lse = (q.new_empty(b, h, t) for _ in range(3))
    drop = dropout_p > 0
    out = q.new_empty(b, h, t, dv) if drop else q.new_empty(0)
    threshold, factor = keep_threshold(dropout_p)
    ptrs, strides = _launch_args(q, k, v, bias, allowed, key_valid, seed)
    bm, bn, bdh, bdv = _block_sizes(q, v, block)
    kern = _kernels(q.device.type == "cpu")
    grid = (triton.cdiv(t, bm), b * h)
    kern.fwd[grid](
        *ptrs, est, m2, psq, lse, out if drop else est, *strides,
        h, t, s, dh, dv, _scalars(q, factor), threshold,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_DH=bdh, BLOCK_DV=bdv,
        HAS_BIAS=bias is not None, HAS_ALLOWED=allowed is not None,
        HAS_KVALID=key_valid is not None, CAUSAL=is_causal, DROPOUT=drop, ACC=_acc_dtype(q),
    )  # fmt: skip
    return est, m2, psq, lse, out


def triton_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    allowed: Tensor | None,
    key_valid: Tensor | None,
    seed: Tensor | None,
    estimate: Tensor,
    second_moment: Tensor,
    sum_p_sq: Tensor,
    lse: Tensor,
    out: Tensor,
    g_est: Tensor | None,
    g_m2: Tensor | None,
    g_p: Tensor | None,
    g_out: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward as :func:`blockwise.blockwise_backward`, by the Triton kernels."""
    if not uses_triton(q):
        return blockwise_backward(q, k, v, bias, allowed, key_valid, seed, estimate,
                                  second_moment, sum_p_sq, lse, out, g_est, g_m2, g_p,
                                  g_out, is_causal, dropout_p, block)  # fmt: skip
    b, h, t, dh = q.shape
    s, dv = k.shape[2], v.shape[3]
    g_e = torch.zeros_like(estimate) if g_est is None else g_est.contiguous()
    g_m = torch.zeros_like(second_moment) if g_m2 is None else g_m2.contiguous()
    g_pp = torch.zeros_like(sum_p_sq) if g_p is None else g_p
    drop = dropout_p > 0 and g_out is not None
    threshold, factor = keep_threshold(dropout_p)
    c = backward_row_sums(g_e, g_m, g_pp, g_out if drop else None, estimate, second_moment,
                          sum_p_sq, out)  # fmt: skip
    c = torch.where(torch.isinf(lse), 0.0, c).contiguous()
    gp2 = (2.0 * g_pp).contiguous()
    go = (g_out * factor).contiguous() if drop and g_out is not None else g_e
    dq = q.new_empty(b, h, t, dh)
    dk = q.new_empty(b, h, s, dh)
    dvv = q.new_empty(b, h, s, dv)
    db = q.new_empty(b, h, s) if bias is not None else q.new_empty(0)
    ptrs, strides = _launch_args(q, k, v, bias, allowed, key_valid, seed)
    bm, bn, bdh, bdv = _block_sizes(q, v, block)
    kern = _kernels(q.device.type == "cpu")
    common = dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_DH=bdh, BLOCK_DV=bdv,
        HAS_BIAS=bias is not None, HAS_ALLOWED=allowed is not None,
        HAS_KVALID=key_valid is not None, CAUSAL=is_causal, DROPOUT=drop, ACC=_acc_dtype(q),
    )  # fmt: skip
    grads = [g_e, g_m, gp2, go, c, lse.contiguous()]
    scalars = [h, t, s, dh, dv, _scalars(q, factor), threshold]
    kern.dkdv[(triton.cdiv(s, bn), b * h)](
        *ptrs, *grads, dk, dvv, db if bias is not None else dk, *strides, *scalars, **common
    )
    kern.dq[(triton.cdiv(t, bm), b * h)](*ptrs, *grads, dq, *strides, *scalars, **common)
    return dq, dk, dvv, db


kriging_fused_op = define_kriging_op("kriging_fused", triton_forward, triton_backward)

DEFAULT_TRITON_BLOCK = 64


def fused_kriging_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    bias: Tensor | None,
    dropout_p: float,
    block_size: int | None = None,
    *,
    key_valid: Tensor | None = None,
    is_causal: bool = False,
) -> Outputs:
    """Kriging attention by the fused kernel; the arguments and returns of
    :func:`blockwise.blockwise_attention`.

    ``block_size``: query and key block of the Triton kernels (a power of two, at
    least 16; None: 64), or the key block of the blockwise version where it runs
    instead (None: ``blockwise.default_block``).
    """
    if block_size is None:
        block_size = DEFAULT_TRITON_BLOCK if uses_triton(q) else default_block(q.shape[-1])
    q, k, v, bias, seed = prepare(q, k, v, bias, allowed, dropout_p, block_size, key_valid,
                                  is_causal)  # fmt: skip
    est, m2, psq, _, out = kriging_fused_op(
        q, k, v, bias, allowed, key_valid, seed, is_causal, float(dropout_p), int(block_size)
    )
    return (out if dropout_p > 0 else est), est, m2, psq


def kriging(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor | None,
    dropout_p: float, chunk_size: int,
) -> tuple[Tensor, Any]:  # fmt: skip
    """The kernel interface (``nn.kernels``): output and ``KrigingStats``.

    ``chunk_size`` (the query block of the chunked kernel) is not used: the key
    block is this kernel's own default.
    """
    from bft_lightning.nn.kernels.reference import KrigingStats

    out, estimate, second_moment, sum_p_sq = fused_kriging_attention(
        q, k, v, allowed, bias, dropout_p
    )
    return out, KrigingStats(second_moment, estimate, sum_p_sq, v)
