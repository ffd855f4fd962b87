"""Filter math specific to a Llama-style decoder (RMSNorm, SwiGLU, GQA, KV cache).

Pure functions in the symbols of ``docs/spec.md``; everything generic
(delta rule, kriging statistics, REML, Kalman gain, predict) lives in
:mod:`bft_lightning.nn.functional` and is reused from there.

Shapes: ``B`` batch, ``T`` new positions, ``Tk`` keys (cached + new), ``H``
query heads, ``Hkv`` key/value heads, ``G`` residual groups, ``F`` FFN width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from bft_lightning.nn import functional as BF
from bft_lightning.nn import jacobian as J


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (Llama's RoPE layout, not interleaved)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of RoPE for integer ``positions`` (B, T): each (B, T, d_h).

    ``inv_freq_i = theta^(-2i / d_h)``; angles are computed in float32.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq  # (B, T, d_h / 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, heads, T, d_h); cos, sin: (B, T, d_h)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv, T, ...) -> (B, Hkv * n_rep, T, ...); head ``a`` reads KV head ``a // n_rep``."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def causal_allowed(valid_keys: Tensor, q_len: int) -> Tensor:
    """Boolean (B, 1, T, Tk) mask for the last ``q_len`` of ``Tk`` positions as queries.

    Query ``t`` (absolute index ``Tk - q_len + t``) may read key ``j`` when the
    key is valid and ``j <= Tk - q_len + t``. With ``q_len == Tk`` this is
    :func:`bft_lightning.nn.attention.build_allowed` with ``is_causal=True``.
    """
    b, tk = valid_keys.shape
    causal = torch.ones(q_len, tk, dtype=torch.bool, device=valid_keys.device)
    causal = causal.tril(diagonal=tk - q_len)
    return (valid_keys[:, None, None, :] & causal).expand(b, 1, q_len, tk)


def swiglu_jacobian_matrices(
    w_gate: Tensor, w_up: Tensor, w_down: Tensor, norm_scale: Tensor | None, groups: int
) -> tuple[Tensor, Tensor]:
    """The two pooled Jacobian matrices of ``SwiGLU(u) = W2 (silu(W1 u) * W3 u)``.

    ``M1[k, g] = mean_{i in g} W2[i, k] W1[k, i] gamma2_i`` and
    ``M3[k, g] = mean_{i in g} W2[i, k] W3[k, i] gamma2_i`` (each F x G), by
    :func:`bft_lightning.nn.functional.ffn_jacobian_matrix`.

    w_gate (W1), w_up (W3): (F, d); w_down (W2): (d, F); norm_scale: (d,).
    """
    m1 = J.ffn_jacobian_matrix(w_gate, w_down, norm_scale, groups)
    m3 = J.ffn_jacobian_matrix(w_up, w_down, norm_scale, groups)
    return m1, m3


def swiglu_pooled_jacobian(
    a: Tensor, b: Tensor, m1: Tensor, m3: Tensor, norm_sigma: Tensor, backward: str = "custom"
) -> Tensor:
    """Group mean of the diagonal SwiGLU Jacobian (``docs/spec.md``, Predict).

    ``J_i = (gamma2_i / sigma2) sum_k W2[i, k] (silu'(a_k) b_k W1[k, i] + silu(a_k) W3[k, i])``
    pooled: ``Jbar = ((silu'(a) b) @ M1 + silu(a) @ M3) / sigma2`` where
    ``sigma2`` is RMSNorm2's denominator (the rms of ``h'``).

    a = W1 u, b = W3 u: (B, T, F); norm_sigma: (B, T). Returns (B, T, G) float32.

    ``backward="custom"``: the two products run as one Function that keeps only
    ``a``, ``b`` (which SwiGLU keeps for its own backward) and the matrices; the
    plain ops (``"autograd"``, for ``torch.compile``) keep three more (B, T, F)
    float32 tensors a layer (``silu'(a)``, ``silu'(a) b`` and ``silu(a)``), which
    at Llama widths (F = 5632) are the largest activations of the layer.
    """
    if backward not in J.BACKWARDS:
        raise ValueError(f"backward must be one of {J.BACKWARDS}, got {backward!r}")
    if backward == "autograd":
        with torch.autocast(a.device.type, enabled=False):  # float32 as in eager mode
            af = BF.upcast(a)
            weighted_gate = J.silu_derivative(af) * BF.upcast(b)
            product = weighted_gate @ m1.to(af.dtype) + F.silu(af) @ m3.to(af.dtype)
    else:
        product = _SwigluJacobianProduct.apply(a, b, m1, m3)
    return product / BF.upcast(norm_sigma).unsqueeze(-1)


class _SwigluJacobianProduct(torch.autograd.Function):
    """``(silu'(a) b) @ M1 + silu(a) @ M3`` (B, T, G) float32, keeping ``a, b, M1, M3`` only.

    Backward, with ``g`` the output's gradient, ``s' = silu'(a)``, ``s'' = silu''(a)``:
    ``dM1 = (s' b)^T g``, ``dM3 = silu(a)^T g``, ``da = (g M1^T) s'' b + (g M3^T) s'``,
    ``db = (g M1^T) s'``; ``s'`` and ``s''`` are recomputed from ``a``. First order
    only (``once_differentiable``): nothing here takes a gradient of a gradient.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, m1: Tensor, m3: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b, m1, m3)
        with torch.autocast(a.device.type, enabled=False):  # float32 under autocast too
            af, bf = BF.upcast(a.detach()), BF.upcast(b.detach())
            m1f, m3f = m1.detach().to(af.dtype), m3.detach().to(af.dtype)
            s = torch.sigmoid(af)
            weighted_gate = J.silu_derivative(af, s).mul_(bf)
            # silu(a) @ M3 + (silu'(a) b) @ M1, each as a product with few columns
            return J.matmul_few_columns(af * s, m3f) + J.matmul_few_columns(weighted_gate, m1f)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        a, b, m1, m3 = ctx.saved_tensors
        with torch.autocast(a.device.type, enabled=False):
            return _SwigluJacobianProduct._grads(ctx.needs_input_grad, grad, a, b, m1, m3)

    @staticmethod
    def _grads(
        needs: tuple[bool, ...], grad: Tensor, a: Tensor, b: Tensor, m1: Tensor, m3: Tensor
    ) -> tuple[Tensor | None, ...]:
        need_a, need_b, need_m1, need_m3 = needs
        af, bf = BF.upcast(a), BF.upcast(b)
        grad = grad.to(af.dtype)
        m1f, m3f = m1.to(af.dtype), m3.to(af.dtype)
        s = torch.sigmoid(af)
        d1 = J.silu_derivative(af, s)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_a = grad_b = grad_m1 = grad_m3 = None
        if need_m1:
            grad_m1 = J.gram_few_columns(d1 * bf, g2).to(m1.dtype)
        if need_m3:
            grad_m3 = J.gram_few_columns(af * s, g2).to(m3.dtype)
        if need_a or need_b:
            via_m1 = grad @ m1f.t()  # (B, T, F)
            if need_b:
                grad_b = (via_m1 * d1).to(b.dtype)
            if need_a:
                d2 = s * (1.0 - s) * (2.0 + af * (1.0 - 2.0 * s))  # silu''(a)
                grad_a = via_m1.mul_(d2).mul_(bf).add_((grad @ m3f.t()).mul_(d1)).to(a.dtype)
        return grad_a, grad_b, grad_m1, grad_m3
