"""The dropout of the blockwise and fused kriging kernels: a counter-based hash.

Query ``i`` and key ``j`` of stream ``bh`` (batch x head) keep their weight
when ``mix32((i S + j) ^ stream[bh]) >> 16 < n``, ``n = round((1 - p) 2^16)``:
the same mask whatever the block size, in PyTorch (``blockwise``) and in Triton
(``fused_triton``, which writes the constants below as literals).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["keep_mask", "keep_threshold", "mix32", "row_streams"]

_MASK_LEVELS = 1 << 16  # the keep probability's resolution (as nn.chunked)
_M32 = 0xFFFFFFFF
# a two-round 32-bit integer hash (xor-shift-multiply; both multipliers below 2^31,
# so that the products of 32-bit values stay within int64)
_H1, _H2 = 0x21F0AAAD, 0x735A2D97
_GOLDEN = 0x9E3779B9


def mix32(x: Tensor) -> Tensor:
    """The 32-bit hash of an int64 tensor holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _H1) & _M32
    x = x ^ (x >> 15)
    x = (x * _H2) & _M32
    return x ^ (x >> 15)


def keep_threshold(dropout_p: float) -> tuple[int, float]:
    """``n = round((1 - p) 2^16)`` (a weight is kept when its 16-bit draw is below
    ``n``) and the kept weights' factor ``2^16 / n`` (0 when nothing is kept)."""
    n = round((1.0 - dropout_p) * _MASK_LEVELS)
    return n, (_MASK_LEVELS / n if n else 0.0)


def row_streams(seed: int, bh: int, device: torch.device) -> Tensor:
    """One 32-bit stream key per (batch, head): (B H,) int64."""
    idx = torch.arange(bh, device=device, dtype=torch.int64)
    return mix32((seed + idx * _GOLDEN) & _M32)


def keep_mask(
    streams: Tensor, rows: tuple[int, int], cols: tuple[int, int], s: int, threshold: int
) -> Tensor:
    """The keep mask (B H, rows, cols) as bool: query ``i`` and key ``j`` of stream
    ``bh`` is kept when ``mix32((i S + j) ^ stream[bh]) >> 16 < threshold``."""
    i = torch.arange(rows[0], rows[1], device=streams.device, dtype=torch.int64)
    j = torch.arange(cols[0], cols[1], device=streams.device, dtype=torch.int64)
    pos = (i[:, None] * s + j[None, :]) & _M32
    x = mix32(pos[None] ^ streams[:, None, None])
    return (x >> 16) < threshold
