"""Serving: what a trained recommender hands a product (lists and their confidence)."""

from bft_lightning.serving.confidence import recommendation_confidence

__all__ = ["recommendation_confidence"]
