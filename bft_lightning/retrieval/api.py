"""``topk`` and ``target_ranks``: what evaluation, predict and recommend rank through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender

if TYPE_CHECKING:
    from bft_lightning.retrieval.faiss_index import ItemIndex
from bft_lightning.retrieval.dense import dense_target_ranks, dense_topk
from bft_lightning.retrieval.scores import Scorer, check_exclude
from bft_lightning.retrieval.tiled import tiled_ranks, tiled_topk


@dataclass(frozen=True)
class TopK:
    """The best items of each user.

    scores: (N, k) float32, best first: ``model.score(hidden, log_prec).float()``'s values.
    ids: (N, k) int64 item ids (1..num_items); 0 where fewer than k items are
        eligible (the score is -inf there).
    logsumexp: (N,) float32 log-sum-exp of the scores over every real item not
        excluded (``exp(scores - logsumexp)`` are softmax probabilities).
    """

    scores: Tensor
    ids: Tensor
    logsumexp: Tensor


def _tiled(scorer: Scorer) -> bool:
    return scorer.users.device.type == "cpu" and scorer.finite_and_bounded()


def _check_rows(hidden: Tensor, log_prec: Tensor | None) -> None:
    if log_prec is not None and log_prec.shape[:1] != hidden.shape[:1]:
        raise ValueError(
            f"log_prec must have one row per hidden state, got {tuple(log_prec.shape)} "
            f"for hidden {tuple(hidden.shape)}"
        )


@torch.no_grad()
def topk(
    model: SequentialRecommender,
    hidden: Tensor,
    log_prec: Tensor | None,
    k: int,
    exclude: Tensor | None = None,
    index: ItemIndex | None = None,
) -> TopK:
    """The k best-scored real items of each user, never the excluded ones.

    Args:
        model: a ``SequentialRecommender``; scores are ``model.score(hidden, log_prec)``
            computed in the weights' dtype with autocast off.
        hidden: (N, d) states predicting the next item; log_prec: (N, G) or None.
        k: items per user, >= 1; past the eligible items the rest is padded
            (id 0, score -inf).
        exclude: optional (N, L) item ids per user that are neither returned nor
            counted in ``logsumexp``; 0 entries (padding) are ignored.
        index: an approximate item index (``faiss_index.ItemIndex``) that finds the
            candidates instead of scoring every item; the scores returned are still
            the model's, the log-sum-exp is estimated (``docs/retrieval.md``).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    _check_rows(hidden, log_prec)
    scorer = Scorer.of(model, hidden, log_prec)
    check_exclude(exclude, hidden.shape[0], scorer.num_items)
    if index is not None:
        v, cols, lse = index.topk(scorer, k, exclude)
        ids = cols + 1
    elif _tiled(scorer):
        v, cols, lse = tiled_topk(scorer, k, exclude)
        ids = cols + 1
    else:
        v, ids, lse = dense_topk(model, hidden, log_prec, k, exclude)
    v = v.float()
    ids = ids.masked_fill(v == float("-inf"), 0)
    if v.shape[1] < k:  # fewer real items than k
        pad = k - v.shape[1]
        v = torch.cat([v, v.new_full((v.shape[0], pad), float("-inf"))], 1)
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], pad)], 1)
    return TopK(v, ids, lse.float())


@torch.no_grad()
def target_ranks(
    model: SequentialRecommender,
    hidden: Tensor,
    log_prec: Tensor | None,
    target: Tensor,
    exclude: Tensor | None = None,
) -> Tensor:
    """0-based pessimistic rank (N,) int64 of each ``target`` item among the real items.

    ``rank = #{j : j != 0, j != t, j not excluded, s_j >= s_t}``: equal to
    :func:`bft_lightning.metrics.ranking.target_ranks` of the full score matrix
    with the excluded items as a mask. A target in its own exclusion list is
    still ranked by its score. NaN scores raise ``ValueError``.
    """
    return _ranks(model, hidden, log_prec, target, exclude, None)[0]


@torch.no_grad()
def ranks_both_ways(
    model: SequentialRecommender,
    hidden: Tensor,
    log_prec: Tensor | None,
    target: Tensor,
    seen: Tensor,
) -> tuple[Tensor, Tensor]:
    """The targets' ranks under both evaluation conventions, from one pass over the scores:
    ``(ranks, ranks_seen_masked)``, the second with the ``seen`` (N, L) item ids (the
    user's history; 0 = padding) excluded. Each equals :func:`target_ranks` with
    ``exclude=None`` and ``exclude=seen`` respectively."""
    ranks, masked = _ranks(model, hidden, log_prec, target, None, seen)
    assert masked is not None
    return ranks, masked


def _ranks(
    model: SequentialRecommender,
    hidden: Tensor,
    log_prec: Tensor | None,
    target: Tensor,
    exclude: Tensor | None,
    seen: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    _check_rows(hidden, log_prec)
    scorer = Scorer.of(model, hidden, log_prec)
    n = scorer.num_items
    if target.shape != hidden.shape[:1]:
        raise ValueError(
            f"target must be (N,) = {tuple(hidden.shape[:1])}, got {tuple(target.shape)}"
        )
    if target.numel() and (target.min() < 1 or target.max() > n):
        raise ValueError(f"target ids must be in 1..{n} (0 is padding)")
    check_exclude(exclude, hidden.shape[0], n)
    check_exclude(seen, hidden.shape[0], n)
    if _tiled(scorer):
        return tiled_ranks(scorer, target, exclude, seen=seen)
    ranks = dense_target_ranks(model, hidden, log_prec, target, exclude)
    if seen is None:
        return ranks, None
    both = seen if exclude is None else torch.cat([exclude, seen], 1)
    return ranks, dense_target_ranks(model, hidden, log_prec, target, both)
