"""The FFN's pooled Jacobian: ``Jbar`` of ``docs/spec.md`` (Predict), for ReLU and GELU.

``ffn_jacobian_matrix`` pools ``W2[i, k] W1[k, i] gamma2_i`` to groups (F, G);
``activation_with_jacobian`` gives the FFN's activation and ``phi'(a) @ M``
(B, T, G) from one call. There is one GELU implementation with a hand-written
backward (:func:`gelu_with_jacobian`, ``backward="custom"``, keeps only ``a``
and ``M``) and the plain formula (:func:`activation_derivative`,
``backward="autograd"``, what ``torch.compile`` traces); the SwiGLU Jacobian is
in ``functional_llama``. Shapes: ``B`` batch, ``T`` positions, ``F`` FFN width,
``G`` groups.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bft_lightning.nn.functional import upcast


def ffn_jacobian_matrix(w1: Tensor, w2: Tensor, norm_scale: Tensor | None, groups: int) -> Tensor:
    """Pooled FFN Jacobian matrix ``M[k, g] = mean_{i in g} W2[i, k] W1[k, i] gamma2_i``.

    For ``FFN(u) = W2 phi(W1 u)`` with ``u = Norm2(h')``, the diagonal of the
    Jacobian is ``J_i = (gamma2_i / sigma2) sum_k W2[i, k] phi'(a_k) W1[k, i]``,
    whose group mean is ``Jbar[t, g] = (phi'(a_t) @ M)[g] / sigma2_t``.

    w1: (F, d); w2: (d, F); norm_scale: (d,) or None. Returns (F, G) float32.
    """
    prod = upcast(w2) * upcast(w1).t()  # (d, F): W2[i, k] W1[k, i]
    if norm_scale is not None:
        prod = prod * upcast(norm_scale).unsqueeze(1)
    d, f = prod.shape
    return prod.reshape(groups, d // groups, f).mean(dim=1).t()


_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# e^x as 2^(x log2 e): PyTorch's CPU exp2 kernel runs faster than its exp
# (results/perf/notes.md), and the extra rounding of x log2 e is of the order of
# the rounding x itself carries
_LOG2E = 1.0 / math.log(2.0)


def silu_derivative(a: Tensor, sigmoid: Tensor | None = None) -> Tensor:
    """``silu'(a) = s (1 + a (1 - s))``, ``s = sigmoid(a)`` (given or computed), float32 or wider.

    Plain ops (autograd differentiates them); HSTU's delta rule and the Llama
    decoder's SwiGLU Jacobian share it.
    """
    af = upcast(a)
    s = torch.sigmoid(af) if sigmoid is None else sigmoid
    return s * (1.0 + af * (1.0 - s))


BACKWARDS = ("custom", "autograd")


def activation_derivative(a: Tensor, activation: str) -> Tensor:
    """``phi'(a)`` for ``relu`` (a step: zero second derivative) and exact ``gelu``
    (``Phi(a) + a phi(a)``), float32 or wider, as plain ops that autograd
    differentiates (``backward="autograd"``)."""
    af = upcast(a)
    if activation == "relu":
        return (af.detach() > 0).to(af.dtype)
    if activation == "gelu":
        return torch.special.ndtr(af) + af * torch.exp(-0.5 * af.square()) * _INV_SQRT_2PI
    raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")


_BLOCK_ELEMENTS = 1 << 18  # a row block of (B T, F) work: 1 MB in float32, cache-sized


def _row_blocks(n: int, f: int, device: torch.device) -> int:
    """Rows per block for (n, f) elementwise work: cache-sized blocks on a CPU,
    one block elsewhere (a GPU's kernels want the whole tensor)."""
    return max(1, min(n, _BLOCK_ELEMENTS // max(f, 1))) if device.type == "cpu" else max(n, 1)


def _gelu_jacobian_forward(a: Tensor, m: Tensor) -> Tensor:
    """``phi'(a) @ M`` for ``a`` (N, F), ``M`` (F, G) float32: (N, G) float32.

    ``phi'(a)`` is PyTorch's fused exact-GELU backward kernel with a gradient of
    ones, evaluated a row block at a time into one reused buffer and multiplied
    into the output block by block: the (N, F) derivative is never allocated
    (on a CPU a fresh FFN-sized buffer costs more in page faults and memory
    traffic than the kernel itself).
    """
    n, f = a.shape
    rows = _row_blocks(n, f, a.device)
    out_t = m.new_empty(m.shape[1], n)  # (G, N): see matmul_few_columns
    ones = torch.ones(rows, f, dtype=m.dtype, device=a.device)
    buf = torch.empty_like(ones)
    m_t = m.t()
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        c = r1 - r0
        _gelu_backward_into(ones[:c], upcast(a[r0:r1]), buf[:c])
        torch.mm(m_t, buf[:c].t(), out=out_t[:, r0:r1])
    return out_t.t()


def _gelu_backward_into(grad: Tensor, a: Tensor, out: Tensor) -> Tensor:
    """``grad * phi'(a)`` of the exact GELU into ``out`` (one fused kernel)."""
    return torch.ops.aten.gelu_backward.grad_input(grad, a, approximate="none", grad_input=out)


def _gelu_jacobian_backward(
    a: Tensor, m: Tensor, g_act: Tensor | None, g_jac: Tensor | None, needs_a: bool, needs_m: bool
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of ``(gelu(a), phi'(a) @ M)`` for ``a`` (N, F), ``M`` (F, G):
    ``da = g_act phi'(a) + (g_jac M^T) phi''(a)`` (float32, N x F) and
    ``dM = phi'(a)^T g_jac``, a row block at a time as in the forward.

    ``phi'(a)`` is PyTorch's fused GELU-backward kernel with a gradient of ones,
    evaluated once per block for both ``g_act phi'(a)`` (a product) and ``dM``
    (when only ``g_act`` is given, GELU's own backward kernel); ``phi''(a) =
    phi(a) (2 - a^2) = (2 / sqrt(2 pi)) e^s (1 + s)`` with ``s = -a^2 / 2``, its
    constant folded into ``M``. Every temporary is a block-sized buffer reused
    across blocks.
    """
    n, f = a.shape
    rows = _row_blocks(n, f, a.device)
    f32 = m.dtype
    grad_a = torch.empty(n, f, dtype=f32, device=a.device) if needs_a else None
    grad_m_t = m.new_zeros(m.shape[1], f) if needs_m and g_jac is not None else None  # (G, F)
    if grad_a is None and grad_m_t is None:
        return None, None
    # buffers only for the work asked for (with no Jacobian gradient, GELU's own
    # kernel gives da: none of them; on a GPU a block is the whole tensor)
    with_jac = g_jac is not None
    dphi_needed = with_jac and (grad_m_t is not None or (grad_a is not None and g_act is not None))
    ones = torch.ones(rows, f, dtype=f32, device=a.device) if dphi_needed else None
    dphi = torch.empty(rows, f, dtype=f32, device=a.device) if dphi_needed else None
    buf = torch.empty(rows, f, dtype=f32, device=a.device) if with_jac and needs_a else None
    expo = torch.empty_like(buf) if buf is not None else None
    m_t = m.t() * (2.0 * _INV_SQRT_2PI)  # (G, F), with the constant of phi'' folded in
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        c = r1 - r0
        ac = upcast(a[r0:r1])
        if g_jac is None:  # GELU's gradient only (grad_a is set, else returned above)
            assert grad_a is not None
            if g_act is None:
                grad_a[r0:r1].zero_()
            else:
                _gelu_backward_into(upcast(g_act[r0:r1]), ac, grad_a[r0:r1])
            continue
        gj = g_jac[r0:r1]
        dp = None
        if ones is not None and dphi is not None:
            dp = _gelu_backward_into(ones[:c], ac, dphi[:c])
        if grad_m_t is not None and dp is not None:  # dM^T += g^T phi'(a), as in the forward
            grad_m_t.addmm_(gj.t(), dp)
        if grad_a is None or buf is None or expo is None:
            continue
        if g_act is not None and dp is not None:
            torch.mul(upcast(g_act[r0:r1]), dp, out=grad_a[r0:r1])
        else:
            grad_a[r0:r1].zero_()
        sq = torch.mul(ac, ac, out=buf[:c])  # a^2; s = -a^2 / 2
        e = torch.mul(sq, -0.5 * _LOG2E, out=expo[:c]).exp2_()  # e^s as 2^(s log2 e)
        e.mul_(sq.mul_(-0.5).add_(1.0))  # e^s (1 + s)
        grad_a[r0:r1].addcmul_(torch.mm(gj, m_t, out=buf[:c]), e)
    return grad_a, None if grad_m_t is None else grad_m_t.t()


@torch.library.custom_op("bft_lightning::gelu_with_jacobian", mutates_args=())
def gelu_with_jacobian(a: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """``gelu(a)`` and ``phi'(a) @ M`` in one custom op that shares ``phi'(a)``.

    Separately, the backward evaluates ``phi'(a)`` twice over (B, T, F): once
    inside GELU's own backward (``grad * phi'(a)``, a fused kernel) and once
    for ``M``'s gradient. Here it is evaluated once, a row block at a time, for
    both: ``da = g_act phi'(a) + (g_jac M^T) phi''(a)``, ``dM = phi'(a)^T g_jac``
    (with no Jacobian gradient, ``da`` is GELU's own fused backward).
    Keeps ``a`` and ``M`` only, like GELU itself; the derivative work runs in
    cache-sized row blocks (:func:`_gelu_jacobian_forward`).

    A ``torch.library`` custom op (with a fake implementation and its backward
    registered as another custom op), not an autograd Function:
    ``torch.compile`` keeps it whole in one graph and its row-block loop does
    not specialise the graph to one sequence length.
    a: (..., F); m: (F, G). Returns (..., F) in ``a``'s dtype and (..., G)
    float32 (float64 for a float64 ``m``).
    """
    act = F.gelu(a)  # as the FFN computes it
    with torch.autocast(a.device.type, enabled=False):  # the precision path: float32
        mf = upcast(m)
        jac = _gelu_jacobian_forward(a.reshape(-1, a.shape[-1]), mf)
        return act, jac.reshape(*a.shape[:-1], mf.shape[1])


@gelu_with_jacobian.register_fake
def _(a: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    mf_dtype = m.dtype if m.dtype in (torch.float32, torch.float64) else torch.float32
    rows = math.prod(a.shape[:-1])  # the real one's layout: a transposed (G, N) buffer
    jac = a.new_empty(m.shape[1], rows, dtype=mf_dtype).t()
    return torch.empty_like(a), jac.reshape(*a.shape[:-1], m.shape[1])


@torch.library.custom_op("bft_lightning::gelu_with_jacobian_backward", mutates_args=())
def gelu_with_jacobian_backward(
    a: Tensor, m: Tensor, g_act: Tensor | None, g_jac: Tensor | None, needs_a: bool, needs_m: bool
) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`gelu_with_jacobian`: ``(da, dM)`` in the dtypes of
    ``a`` and ``m``; a gradient not asked for (or zero by construction, no
    ``g_jac`` for ``dM``) comes back as an empty (0,) tensor."""
    mf = upcast(m)
    f = a.shape[-1]
    with torch.autocast(a.device.type, enabled=False):
        grad_a, grad_m = _gelu_jacobian_backward(
            a.reshape(-1, f),
            mf,
            None if g_act is None else g_act.reshape(-1, f),
            None if g_jac is None else g_jac.reshape(-1, mf.shape[1]),
            needs_a,
            needs_m,
        )
    da = a.new_empty(0) if grad_a is None else grad_a.view(a.shape).to(a.dtype).contiguous()
    dm = m.new_empty(0) if grad_m is None else grad_m.to(m.dtype).contiguous()
    return da, dm


@gelu_with_jacobian_backward.register_fake
def _(a, m, g_act, g_jac, needs_a, needs_m):  # type: ignore[no-untyped-def]
    # contiguous, as the real ones (``m`` itself is often a transposed view)
    da = a.new_empty(a.shape) if needs_a else a.new_empty(0)
    dm = m.new_empty(m.shape) if needs_m and g_jac is not None else m.new_empty(0)
    return da, dm


def _gelu_setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _gelu_grad(
    ctx: Any, g_act: Tensor | None, g_jac: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    a, m = ctx.saved_tensors
    needs_a, needs_m = ctx.needs_input_grad
    da, dm = gelu_with_jacobian_backward(a, m, g_act, g_jac, needs_a, needs_m)
    return (da if needs_a else None), (dm if needs_m and g_jac is not None else None)


gelu_with_jacobian.register_autograd(_gelu_grad, setup_context=_gelu_setup_context)


def activation_with_jacobian(
    a: Tensor, m: Tensor, activation: str, backward: str = "custom"
) -> tuple[Tensor, Tensor]:
    """``(phi(a), phi'(a) @ M)``: the FFN's activation and the Jacobian product.

    a: (B, T, F); m: (F, G). Returns (B, T, F) in ``a``'s dtype (the activation
    follows autocast like the FFN's own) and (B, T, G) float32, autocast off.

    ``backward="custom"`` with the exact GELU: one Function evaluates ``phi'(a)``
    once in the backward for both and keeps only ``a`` and ``M``
    (:func:`gelu_with_jacobian`). ``"autograd"``, and ReLU (whose derivative is
    a step), use plain ops (:func:`activation_derivative`). Same values and
    gradients.
    """
    if activation not in ("relu", "gelu"):
        raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if activation == "gelu" and backward == "custom":
        act, jac = gelu_with_jacobian(a, m)
        return act, jac
    act = F.gelu(a) if activation == "gelu" else F.relu(a)
    with torch.autocast(a.device.type, enabled=False):  # the precision path: float32
        return act, activation_derivative(a, activation) @ upcast(m)


def matmul_few_columns(x: Tensor, m: Tensor) -> Tensor:
    """``x @ m`` for ``x`` (..., F) and ``m`` (F, G) with few columns ``G`` (the
    Jacobian products' group counts), returned as (..., G) (a transposed view).

    Computed as ``(m^T x^T)^T``: the same sums, but a (G, F) x (F, N) product,
    which the CPU BLAS runs much faster than an (N, F) x (F, G) one with a G-wide
    output (``results/perf/notes.md``).
    """
    f = x.shape[-1]
    return torch.mm(m.t(), x.reshape(-1, f).t()).t().view(*x.shape[:-1], m.shape[1])


def gram_few_columns(x: Tensor, g: Tensor) -> Tensor:
    """``x^T @ g`` (F, G) for ``x`` (..., F) and ``g`` (..., G) with few columns,
    computed as ``(g^T x)^T`` for the reason given in :func:`matmul_few_columns`."""
    return torch.mm(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1])).t()
