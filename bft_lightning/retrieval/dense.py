"""The dense fallback: ``model.score`` over all items for a chunk of users at a time.

Taken for tensors off the CPU (a GPU computes a chunk's full scores faster than
many small tiles) and for inputs whose scores may not be finite (NaN or inf
factors, a product that could overflow): there the full scores are checked
for NaN, as evaluation always did. The ranks are
:func:`bft_lightning.metrics.ranking.target_ranks` of those scores, the
definition of the rank, with the user's excluded items as a mask over the
chunk only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bft_lightning.metrics.ranking import target_ranks as ranks_of_scores
from bft_lightning.models.base import SequentialRecommender

CHUNK_ELEMENTS = 1 << 24  # scores per chunk (64 MB in float32)


def _chunks(users: int, items: int) -> list[slice]:
    size = max(1, CHUNK_ELEMENTS // max(items, 1))
    return [slice(i, min(i + size, users)) for i in range(0, users, size)]


def chunk_scores(model: SequentialRecommender, hidden: Tensor, log_prec: Tensor | None) -> Tensor:
    """``model.score(hidden.to(weights), log_prec).float()`` with autocast off, (c, N + 1);
    refuses NaN."""
    weights = model.item_weights()
    with torch.autocast(hidden.device.type, enabled=False):
        scores = model.score(hidden.to(weights.dtype), log_prec).float()
    if scores.numel() and torch.isnan(scores.amax(dim=1)).any():  # a max is NaN iff a value is
        raise ValueError("scores contain NaN; ranks are undefined (check the model output)")
    return scores


def _part(x: Tensor | None, rows: slice) -> Tensor | None:
    return None if x is None else x[rows]


@torch.no_grad()
def dense_topk(
    model: SequentialRecommender,
    hidden: Tensor,
    log_prec: Tensor | None,
    k: int,
    exclude: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k scores (U, min(k, N)) and item ids, best first, and log-sum-exp (U,)."""
    n = model.item_weights().shape[0] - 1
    vals, ids, lses = [], [], []
    for rows in _chunks(hidden.shape[0], n + 1):
        scores = chunk_scores(model, hidden[rows], _part(log_prec, rows))  # (c, N + 1)
        ex = _part(exclude, rows)
        if ex is not None:  # id 0 hits the padding column, already -inf
            scores.scatter_(1, ex.long(), float("-inf"))
        v, i = scores.topk(min(k, n), dim=1)
        vals.append(v)
        ids.append(i)
        lses.append(torch.logsumexp(scores, dim=1))
    if not vals:
        empty = hidden.new_empty(0, min(k, n), dtype=torch.float32)
        return empty, empty.long(), empty.new_empty(0)
    return torch.cat(vals), torch.cat(ids), torch.cat(lses)


@torch.no_grad()
def dense_target_ranks(
    model: SequentialRecommender,
    hidden: Tensor,
    log_prec: Tensor | None,
    target: Tensor,
    exclude: Tensor | None,
) -> Tensor:
    """Pessimistic ranks (U,) of ``target`` from each chunk's full scores."""
    n = model.item_weights().shape[0] - 1
    parts = [torch.empty(0, dtype=torch.long, device=hidden.device)]
    for rows in _chunks(hidden.shape[0], n + 1):
        scores = chunk_scores(model, hidden[rows], _part(log_prec, rows))
        mask = None
        ex = _part(exclude, rows)
        if ex is not None:
            mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ex.long(), True)
        parts.append(ranks_of_scores(scores, target[rows], mask))
    return torch.cat(parts)
