"""Retrieval: one tiled top-k and one tiled rank count, with seen-item exclusion.

Evaluation (the targets' ranks), predict and recommend (the top k) all rank
through :func:`topk` and :func:`target_ranks`. See ``docs/retrieval.md``.
"""

from bft_lightning.retrieval.api import TopK, ranks_both_ways, target_ranks, topk

__all__ = ["TopK", "ranks_both_ways", "target_ranks", "topk"]
