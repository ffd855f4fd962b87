"""Shared inputs and the reference for the kernel tests."""

from __future__ import annotations

import torch
from torch import Tensor

from bft_lightning.nn.attention import build_allowed, reference_attention
from bft_lightning.nn.kernels.dropout_hash import keep_mask, keep_threshold, row_streams


def inputs(
    b: int,
    h: int,
    t: int,
    dh: int,
    causal: bool,
    pad: int,
    seed: int,
    dtype: torch.dtype = torch.float64,
    dv: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k, v, bias, key_valid and the (B, 1, T, T) mask.

    Left padding of ``pad`` keys in the first sequence (with a causal mask its
    first rows have no key at all); with b > 1 the last sequence has a single
    valid key, the last one (every row but the last is empty when causal)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, t, dh, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(b, h, t, dv or dh, generator=g, dtype=dtype)
    bias = torch.randn(b, h, t, generator=g, dtype=dtype)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :pad] = False
    if b > 1:
        valid[-1] = False
        valid[-1, -1] = True
    if b > 2:
        valid[1] = False
    return q, k, v, bias, valid, build_allowed(valid, causal)


def reference(q, k, v, allowed, bias, keep: Tensor | None = None, factor: float = 1.0):
    """The reference's (out, estimate, second moment, sum p^2); with a keep mask
    (B, H, T, S), the output is ``sum_j p_j m_j f v_j`` on the reference's weights."""
    out, weights, stats = reference_attention(q, k, v, allowed, bias, 0.0, True, True)
    assert stats is not None and weights is not None
    if keep is not None:
        out = (weights * keep.to(weights.dtype) * factor) @ v
    return out, stats.estimate, stats.second_moment, stats.sum_p_sq


def full_keep_mask(seed: int, b: int, h: int, t: int, s: int, dropout_p: float) -> Tensor:
    """The kernels' keep mask over all (T x S) pairs (small shapes only)."""
    threshold, _ = keep_threshold(dropout_p)
    streams = row_streams(seed, b * h, torch.device("cpu"))
    return keep_mask(streams, (0, t), (0, s), s, threshold).view(b, h, t, s)


def weighted_sum(outs, weights) -> Tensor:
    return sum((o * w).sum() for o, w in zip(outs, weights, strict=True))


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
