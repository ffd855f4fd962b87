"""Serving: a checkpoint and its vocabulary -> raw item ids, scores, confidence.

``Recommender`` (the Python API), ``RecommendationWriter`` (``predict`` to a
file), ``recommendation_confidence`` (one number per list) and
``python -m bft_lightning recommend`` (:mod:`.cli`). See ``docs/recommend.md``
and ``docs/confidence.md``.
"""

from .confidence import recommendation_confidence
from .recommender import Recommendation, Recommender, UnknownItemsError
from .writer import RecommendationWriter

__all__ = [
    "Recommendation",
    "RecommendationWriter",
    "Recommender",
    "UnknownItemsError",
    "recommendation_confidence",
]
