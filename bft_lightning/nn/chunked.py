"""Moved to :mod:`bft_lightning.nn.kernels.chunked`; this name is kept for old imports."""

from bft_lightning.nn.kernels.chunked import *  # noqa: F403
from bft_lightning.nn.kernels.chunked import (  # noqa: F401
    _MASK_LEVELS,
    _block,
    _ChunkedKriging,
    _full_precision_matmul,
    _keep_bits,
    _key_spans,
    chunked_attention,
    masked_value,
)
