"""Moved to :mod:`bft_lightning.nn.kernels.chunked` (and ``kernels.chunks``); this name
is kept for old imports."""

from bft_lightning.nn.kernels.chunked import _ChunkedKriging, chunked_attention
from bft_lightning.nn.kernels.chunks import (
    _MASK_LEVELS,
    _block,
    _full_precision_matmul,
    _keep_bits,
    _key_spans,
)
from bft_lightning.nn.kernels.reference import masked_value

__all__ = [
    "_MASK_LEVELS",
    "_ChunkedKriging",
    "_block",
    "_full_precision_matmul",
    "_keep_bits",
    "_key_spans",
    "chunked_attention",
    "masked_value",
]
