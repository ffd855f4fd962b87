"""bft-lightning: the Bayesian Filtering Transformer on PyTorch Lightning."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Recommender", "__version__"]


def __getattr__(name: str) -> Any:
    """``from bft_lightning import Recommender``; a bare ``import bft_lightning`` loads no torch."""
    if name == "Recommender":
        from bft_lightning.serving import Recommender

        return Recommender
    raise AttributeError(f"module 'bft_lightning' has no attribute {name!r}")
