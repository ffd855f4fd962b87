"""The reference kriging kernel (materialised weights) and the fused plain kernel.

``docs/spec.md``, Observe (steps 2-5) and Attention implementations. The reference is
what every other kernel is tested against (``tests/nn/test_chunked.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bft_lightning.nn.functional import upcast

MASKED = -1e30  # finite: an empty row stays finite


def masked_value(dtype: torch.dtype) -> float:
    """A finite logit for blocked keys: -1e30, or the dtype's lowest for half types."""
    return max(MASKED, torch.finfo(dtype).min)


@dataclass
class KrigingStats:
    """What the filter needs from one attention call (all float32, before dropout).

    second_moment: (B, H, T) ``sum_j p ||v_j||^2 / d_h``
    estimate: (B, H, T, d_h) ``e = sum_j p v_j``
    sum_p_sq: (B, H, T) ``sum_j p^2`` (0 for a row with no valid key)
    values: (B, H, S, d_h) the values, for the sill's running statistic
    """

    second_moment: Tensor
    estimate: Tensor
    sum_p_sq: Tensor
    values: Tensor


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    bias: Tensor | None,
    dropout_p: float,
    with_stats: bool,
    need_weights: bool = True,
) -> tuple[Tensor, Tensor, KrigingStats | None]:
    """Materialised kriging attention.

    ``p = softmax_j(q.k / sqrt(d_h) + bias_j)`` over allowed keys; rows with no
    allowed key give ``p = 0``. With statistics, the scores are computed in
    float32 (the spread is a difference of two large numbers), and one product
    with the values ``[v, ||v||^2 / d_h]`` gives both the estimate and the
    second moment. The bias is fused into the score product (``baddbmm``) and
    empty rows are zeroed on the (T x d_h) outputs, not on the (T x T) weights.

    q: (B, H, T, d_h); k, v: (B, H, S, d_h); allowed: (B, 1, T, S); bias:
    (B, H, S) per key. Returns the estimate with dropout (B, H, T, d_h), the
    weights before dropout (B, H, T, S; exact only with ``need_weights``) and the
    statistics (or None).
    """
    if with_stats:
        q, k, v = upcast(q), upcast(k), upcast(v)
    b, h, t, dh = q.shape
    s = k.shape[2]
    scale = 1.0 / math.sqrt(dh)
    qf, kf = q.reshape(b * h, t, dh), k.reshape(b * h, s, dh).transpose(1, 2)
    if bias is None:
        scores = torch.bmm(qf, kf) * scale  # (B H, T, S)
    else:
        scores = torch.baddbmm(bias.reshape(b * h, 1, s).to(q.dtype), qf, kf, alpha=scale)
    scores = scores.view(b, h, t, s).masked_fill(~allowed, masked_value(scores.dtype))
    p = torch.softmax(scores, dim=-1)  # (B, H, T, S)
    has_key = allowed.any(dim=-1, keepdim=True).to(p.dtype)  # (B, 1, T, 1)
    p_drop = F.dropout(p, dropout_p) if dropout_p > 0 else p
    weights = p * has_key if need_weights else p
    if not with_stats:
        return (p_drop @ v) * has_key, weights, None
    v_aug = torch.cat([v, v.square().mean(dim=-1, keepdim=True)], dim=-1)  # (B, H, S, d_h + 1)
    e_aug = (p @ v_aug) * has_key  # (B, H, T, d_h + 1)
    estimate, second_moment = e_aug[..., :-1], e_aug[..., -1]
    out = (p_drop @ v) * has_key if dropout_p > 0 else estimate
    sum_p_sq = (p.unsqueeze(-2) @ p.unsqueeze(-1)).view(b, h, t) * has_key.view(b, 1, t)
    stats = KrigingStats(
        second_moment=second_moment, estimate=estimate, sum_p_sq=sum_p_sq, values=v
    )
    return out, weights, stats


def kriging(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor | None,
    dropout_p: float, chunk_size: int,
) -> tuple[Tensor, KrigingStats]:  # fmt: skip
    """The kernel interface (``nn.kernels``) of the reference: output and statistics."""
    out, _, stats = reference_attention(q, k, v, allowed, bias, dropout_p, True, False)
    assert stats is not None
    return out, stats


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, dropout_p: float) -> Tensor:
    """Fused softmax attention (no bias, no statistics); rows with no allowed key give 0.

    q: (B, H, T, d_h); k, v: (B, H, S, d_h); allowed: (B, 1, T, S). Returns (B, H, T, d_h).
    """
    has_key = allowed.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
    safe = allowed | ~has_key
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, dropout_p=dropout_p)
    return out * has_key.to(out.dtype)
