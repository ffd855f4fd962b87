"""Losses over ``k`` uniform negatives drawn for each row: binary cross-entropy and the
per-row sampled softmax (``loss="bce"`` and ``loss="sampled_softmax"``).

Each row scores its own ``1 + k`` candidates, an ``(N, 1 + k, d)`` gather. The
draws are those of the task before the losses had a module of their own (one
``torch.randint`` of ``(N, k)``), so runs reproduce. Negatives are uniform and
carry no log-Q correction (with uniform negatives and no in-batch candidates it
would be a constant); :class:`~.sampled.SampledSoftmax` shares its negatives
across the batch and corrects for popularity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender

from .base import NoFrequency, check_int


def _row_candidates(
    model: SequentialRecommender, num_negatives: int, hidden: Tensor, target: Tensor,
    log_prec: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(negatives (N, k), logits (N, 1 + k) of [target, negatives])."""
    neg = torch.randint(1, model.num_items + 1, (len(target), num_negatives), device=target.device)
    cand = torch.cat([target.unsqueeze(1), neg], dim=1)
    return neg, model.score(hidden, log_prec, items=cand).float()


class BCE(NoFrequency):
    """``loss="bce"``: ``softplus(-pos) + mean softplus(neg)`` over ``k`` uniform negatives
    per row; a negative equal to the row's target is left out of the mean."""

    def __init__(self, num_negatives: int = 100) -> None:
        self.num_negatives = check_int("num_negatives", num_negatives, 1)

    def __call__(
        self,
        model: SequentialRecommender,
        hidden: Tensor,
        target: Tensor,
        log_prec: Tensor | None,
    ) -> Tensor:
        neg, logits = _row_candidates(model, self.num_negatives, hidden, target, log_prec)
        pos, negs = logits[:, 0], logits[:, 1:]
        valid = (neg != target.unsqueeze(1)).float()
        neg_loss = (F.softplus(negs) * valid).sum(1) / valid.sum(1).clamp_min(1)
        return (F.softplus(-pos) + neg_loss).mean()


class RowSampledSoftmax(NoFrequency):
    """``loss="sampled_softmax"``: softmax over the target and ``k`` uniform negatives of
    its own row, logits divided by ``temperature``; a negative equal to the target
    is masked."""

    def __init__(self, num_negatives: int = 100, temperature: float = 1.0) -> None:
        self.num_negatives = check_int("num_negatives", num_negatives, 1)
        self.temperature = temperature

    def __call__(
        self,
        model: SequentialRecommender,
        hidden: Tensor,
        target: Tensor,
        log_prec: Tensor | None,
    ) -> Tensor:
        neg, logits = _row_candidates(model, self.num_negatives, hidden, target, log_prec)
        logits = logits / self.temperature
        logits[:, 1:] = logits[:, 1:].masked_fill(neg == target.unsqueeze(1), float("-inf"))
        return F.cross_entropy(logits, torch.zeros_like(target))
