"""Pure PyTorch BFT building blocks (no Lightning import here)."""

from bft_lightning.nn.attention import KrigingAttention
from bft_lightning.nn.layers import BFTEncoder, BFTEncoderLayer
from bft_lightning.nn.prior import MLPPrecisionPrior, PrecisionPrior
from bft_lightning.nn.stats import FilterRecorder, FilterStats, find_filter_layers, set_recording

__all__ = [
    "BFTEncoder",
    "BFTEncoderLayer",
    "FilterRecorder",
    "FilterStats",
    "KrigingAttention",
    "MLPPrecisionPrior",
    "PrecisionPrior",
    "find_filter_layers",
    "set_recording",
]
