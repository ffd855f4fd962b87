"""Top-k retrieval over all items (minimal version: one full score matrix per call).

``TopK`` is what ranking consumers read: the best ``k`` items of each row, best
first, and the log-sum-exp of the scores over every real, non-excluded item
(so that softmax probabilities of the listed items can be formed without the
full score matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TopK:
    """The ``k`` best items of ``N`` rows.

    scores: (N, k) float32, best first (``-inf`` where fewer than ``k`` items remain)
    ids: (N, k) int64 item ids (0 = no item, its score ``-inf``)
    logsumexp: (N,) float32, over every real, non-excluded item
    """

    scores: Tensor
    ids: Tensor
    logsumexp: Tensor


@torch.no_grad()
def topk(
    model: torch.nn.Module,
    hidden: Tensor,
    log_prec: Tensor | None,
    k: int,
    exclude: Tensor | None = None,
) -> TopK:
    """Score every item for each state and keep the ``k`` best.

    hidden: (N, d); log_prec: (N, G) or None; exclude: (N, num_items + 1) bool,
    True for items that must not be listed (seen items, for instance).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    weights = model.item_emb.weight.dtype  # type: ignore[union-attr]
    with torch.autocast(hidden.device.type, enabled=False):
        scores = model.score(hidden.to(weights), log_prec).float()  # type: ignore[operator, arg-type]
    if exclude is not None:
        if exclude.shape != scores.shape:
            raise ValueError(
                f"exclude has shape {tuple(exclude.shape)}, the scores {tuple(scores.shape)}"
            )
        scores = scores.masked_fill(exclude, float("-inf"))
    scores[:, 0] = float("-inf")  # padding is never an item
    k_eff = min(k, scores.shape[1])
    values, ids = torch.topk(scores, k_eff, dim=1)
    ids = torch.where(torch.isfinite(values), ids, torch.zeros_like(ids))
    if k_eff < k:  # fewer items than k: pad with "no item"
        pad = k - k_eff
        values = torch.cat([values, values.new_full((len(values), pad), float("-inf"))], 1)
        ids = torch.cat([ids, ids.new_zeros((len(ids), pad))], 1)
    return TopK(scores=values, ids=ids, logsumexp=torch.logsumexp(scores, dim=1))
