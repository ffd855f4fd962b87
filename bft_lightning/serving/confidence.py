"""Confidence of a recommendation list (minimal version: softmax mass of the top-k)."""

from __future__ import annotations

import torch
from torch import Tensor

from bft_lightning.retrieval import TopK

__all__ = ["recommendation_confidence"]


def recommendation_confidence(model, hidden: Tensor, log_prec: Tensor | None, top: TopK) -> Tensor:  # type: ignore[no-untyped-def]
    """(N,) float32: the softmax probability mass of the top-k items."""
    return torch.exp(torch.logsumexp(top.scores, dim=1) - top.logsumexp).float()
