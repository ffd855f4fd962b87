"""LightningModules: sequential recommendation (and LM fine-tuning)."""

from bft_lightning.tasks.recommendation import SequentialRecommendation

__all__ = ["SequentialRecommendation"]
