"""The language model's token losses: cross-entropy (with label smoothing) and focal loss.

Kept apart from ``bft_lightning.losses`` (the recommendation losses over an item
catalogue): these read the LM's ``(B, T)`` labels with ``-100`` where a position
has no target.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["IGNORE_INDEX", "LOSSES", "token_loss"]

LOSSES = ("ce", "focal")
IGNORE_INDEX = -100


def token_loss(
    logits: Tensor, labels: Tensor, kind: str = "ce", gamma: float = 2.0, smoothing: float = 0.0
) -> Tensor:
    """Mean over labelled tokens of ``-log p`` (``ce``) or ``-(1 - p)^gamma log p`` (``focal``).

    logits: (B, T, V); labels: (B, T) with ``-100`` where there is no target.
    Only the labelled rows are normalised (in float32), so memory is O(N V).
    ``smoothing`` (``ce`` only): label smoothing, ``(1 - s) (-log p_y) + s mean_v(-log p_v)``.
    """
    sel = labels != IGNORE_INDEX
    if not bool(sel.any()):
        return logits.sum() * 0.0
    logp = F.log_softmax(logits[sel].float(), dim=-1)  # (N, V)
    logp_y = logp.gather(1, labels[sel].unsqueeze(1)).squeeze(1)  # (N,)
    if kind == "ce":
        if smoothing:
            return -((1.0 - smoothing) * logp_y + smoothing * logp.mean(-1)).mean()
        return -logp_y.mean()
    if kind == "focal":
        # 1 - p floored at 2^-24: with gamma < 1 the derivative of (1 - p)^gamma is
        # infinite at p = 1 (a confident token), which made the gradient NaN
        return -((1.0 - logp_y.exp()).clamp_min(2.0**-24).pow(gamma) * logp_y).mean()
    raise ValueError(f"loss must be one of {LOSSES}, got {kind!r}")
