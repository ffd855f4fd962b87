"""The loss of one training batch: the labelled positions, the configured loss, its normaliser.

``batch_loss`` is what a training step calls after encoding a batch: it keeps
the positions with a label (``labels > 0``), hands their states to the
configured :class:`~.base.Loss` (which samples its negatives, if it samples,
and scores them through the model's head) and divides by what
``loss_normalization`` names.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender

from .base import Loss

NORMALIZATIONS = ("targets", "rows")


class BatchLoss(NamedTuple):
    """``mean``: the per-target mean (logged as ``train/loss``); ``value``: what is
    minimised; ``divisor``: what ``value`` is a mean over (targets or rows), a 0-d
    tensor; ``targets``: the batch's count of targets."""

    mean: Tensor
    value: Tensor
    divisor: Tensor
    targets: int


def check_normalization(normalization: str) -> str:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"loss_normalization must be 'targets' or 'rows', got {normalization!r}")
    return normalization


def batch_loss(
    loss: Loss,
    model: SequentialRecommender,
    hidden: Tensor,
    labels: Tensor,
    log_prec: Tensor | None,
    normalization: str = "rows",
) -> BatchLoss:
    """The loss of a batch of ``B`` rows of ``T`` positions.

    Args:
        loss: the configured loss (``build_loss``).
        model: the recommender whose head scores items.
        hidden: ``(B, T, d)`` encoder states.
        labels: ``(B, T)`` target item ids, 0 where a position has no target.
        log_prec: ``(B, T, G)`` final log-precision, or None (``precision="off"``).
        normalization: ``"rows"`` divides the batch's summed loss by its rows,
            ``"targets"`` by its targets (see the task's ``loss_normalization``).
    """
    sel = labels > 0  # (B, T)
    lp = None if log_prec is None else log_prec[sel]  # (N, G)
    mean = loss(model, hidden[sel], labels[sel], lp)
    targets = sel.sum()
    if normalization == "rows":
        rows = torch.full_like(targets, labels.shape[0])
        return BatchLoss(mean, mean * targets / rows, rows, int(targets))
    return BatchLoss(mean, mean, targets, int(targets))
