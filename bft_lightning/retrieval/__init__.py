"""Top-k retrieval over the item catalogue (minimal version: full scores + ``torch.topk``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TopK", "topk"]


@dataclass(frozen=True)
class TopK:
    """scores (N, k) float32 best first; ids (N, k) int64 item indices (0 and -inf where
    fewer than k items are eligible); logsumexp (N,) float32 over real non-excluded items."""

    scores: Tensor
    ids: Tensor
    logsumexp: Tensor


def topk(model, hidden: Tensor, log_prec: Tensor | None, k: int, exclude: Tensor | None = None):  # type: ignore[no-untyped-def]
    """The ``k`` best items of each state; ``exclude`` (N, L) item indices, 0 ignored."""
    scores = model.score(hidden, log_prec).float()  # (N, V + 1), column 0 at -inf
    if exclude is not None:
        scores = scores.scatter(1, exclude, float("-inf"))
        scores[:, 0] = float("-inf")
    top, ids = torch.topk(scores, k, dim=1)
    ids = ids.masked_fill(torch.isinf(top), 0)
    return TopK(top, ids, torch.logsumexp(scores, dim=1))
