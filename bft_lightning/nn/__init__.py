"""Pure PyTorch BFT building blocks (no Lightning import here)."""

from bft_lightning.nn.attention import KrigingAttention
from bft_lightning.nn.hstu import HSTUEncoder, HSTULayer, RelativeAttentionBias
from bft_lightning.nn.layers import BFTEncoder, BFTEncoderLayer
from bft_lightning.nn.prior import MLPPrecisionPrior, PrecisionPrior
from bft_lightning.nn.stats import FilterRecorder, FilterStats, find_filter_layers, set_recording

__all__ = [
    "BFTEncoder",
    "BFTEncoderLayer",
    "FilterRecorder",
    "FilterStats",
    "HSTUEncoder",
    "HSTULayer",
    "KrigingAttention",
    "MLPPrecisionPrior",
    "PrecisionPrior",
    "RelativeAttentionBias",
    "find_filter_layers",
    "set_recording",
]
