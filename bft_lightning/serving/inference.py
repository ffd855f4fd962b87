"""One ranking step shared by ``predict`` and :class:`~.recommender.Recommender`."""

from __future__ import annotations

import torch
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender
from bft_lightning.nn.stats import set_recording
from bft_lightning.retrieval import TopK, topk

from .confidence import recommendation_confidence

__all__ = ["rank_next"]


@torch.no_grad()
def rank_next(
    model: SequentialRecommender,
    input_ids: Tensor,
    k: int,
    times: Tensor | None = None,
    exclude: Tensor | None = None,
) -> tuple[TopK, Tensor]:
    """The ``k`` best next items after each left-padded history, and their confidence.

    input_ids: (N, L) item indices, 0 = padding, L <= max_len; exclude: (N, M)
    item indices never recommended (0 ignored). The filter layers record their
    statistics for the confidence when the model has precision on, as the
    task's evaluation does, and stop afterwards. Scores are computed in the
    weights' dtype, outside autocast (see the task's evaluation).
    """
    set_recording(model, model.precision == "on")
    try:
        hidden, log_prec = model.last_hidden(input_ids, times)
        weights = model.item_emb.weight.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            hidden = hidden.to(weights)
            top = topk(model, hidden, log_prec, k, exclude)
            confidence = recommendation_confidence(model, hidden, log_prec, top)
    finally:
        set_recording(model, False)
    return top, confidence.float()
