"""One ranking step shared by ``predict`` and :class:`~.recommender.Recommender`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender
from bft_lightning.nn.stats import set_recording
from bft_lightning.retrieval import TopK, topk

if TYPE_CHECKING:
    from bft_lightning.retrieval.faiss_index import ItemIndex

from .confidence import recommendation_confidence
from .hit_calibration import ConfidenceCalibration, confidence_features

__all__ = ["list_features", "rank_next"]


@torch.no_grad()
def _rank(
    model: SequentialRecommender,
    input_ids: Tensor,
    width: int,
    times: Tensor | None,
    exclude: Tensor | None,
    feature_k: int | None,
    item_log_count: Tensor | None,
    index: ItemIndex | None = None,
) -> tuple[TopK, Tensor]:
    """The first ``width`` items and either the (N, F) ``confidence_features`` of
    their first ``feature_k`` or (``feature_k`` None) the (N,) ``recommendation_confidence``."""
    set_recording(model, model.precision == "on")
    try:
        hidden, log_prec, norm_scale = model.last_encoded(input_ids, times)
        with torch.autocast(hidden.device.type, enabled=False):
            hidden = hidden.to(model.item_emb.weight.dtype)
            top = topk(model, hidden, log_prec, width, exclude, index)
            if feature_k is None:
                conf = recommendation_confidence(model, hidden, log_prec, top, norm_scale)
                return top, conf.float()
            if item_log_count is None:
                raise ValueError("a calibrated confidence needs item_log_count")
            length = (input_ids > 0).sum(1)  # (N,) items read
            x = confidence_features(model, log_prec, top, feature_k, length,
                                    input_ids[:, -1], item_log_count, norm_scale)  # fmt: skip
            return top, x
    finally:
        set_recording(model, False)


def list_features(
    model: SequentialRecommender,
    input_ids: Tensor,
    k: int,
    item_log_count: Tensor,
    times: Tensor | None = None,
    exclude: Tensor | None = None,
    index: ItemIndex | None = None,
) -> tuple[TopK, Tensor]:
    """The first ``k + 1`` items after each history and the (N, F)
    ``confidence_features`` of the first ``k`` (what a calibration is fit on)."""
    return _rank(model, input_ids, k + 1, times, exclude, k, item_log_count, index)


def rank_next(
    model: SequentialRecommender,
    input_ids: Tensor,
    k: int,
    times: Tensor | None = None,
    exclude: Tensor | None = None,
    calibration: ConfidenceCalibration | None = None,
    item_log_count: Tensor | None = None,
    index: ItemIndex | None = None,
) -> tuple[TopK, Tensor]:
    """The ``k`` best next items after each left-padded history, and their confidence.

    input_ids: (N, L) item indices, 0 = padding, L <= max_len; exclude: (N, M)
    item indices never recommended (0 ignored). The filter layers record their
    statistics for the confidence when the model has precision on, as the
    task's evaluation does, and stop afterwards. Scores are computed in the
    weights' dtype, outside autocast (see the task's evaluation).

    With a ``calibration`` (and ``item_log_count``, (num_items + 1,) ``log(1 +
    training count)``), the confidence is its ``P(next item among the first
    calibration.k)`` from the features of the first ``calibration.k + 1``
    items of this same list (exclusions applied); without one,
    ``recommendation_confidence``. A calibration for lists as long as the
    catalogue is not applied. ``index``: rank through an approximate item index
    (``retrieval.topk``).
    """
    if calibration is None or calibration.k >= model.num_items:
        return _rank(model, input_ids, k, times, exclude, None, None, index)
    width = min(max(k, calibration.k + 1), model.num_items)
    top, x = _rank(model, input_ids, width, times, exclude, calibration.k, item_log_count, index)
    confidence = calibration.probability(x).to(top.scores.device)
    return TopK(scores=top.scores[:, :k], ids=top.ids[:, :k], logsumexp=top.logsumexp), confidence
