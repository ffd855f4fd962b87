"""Training losses of the recommendation task; ``build_loss`` is what a config picks.

==========================  ==================================================
``loss``                    what it computes
==========================  ==================================================
``"ce"``                    :class:`FullSoftmax`, exact, ``(N, items)`` logits
``"ce_chunked"``            :class:`ChunkedSoftmax`, the same loss in item chunks
``"sampled_softmax_logq"``  :class:`SampledSoftmax`, shared in-batch + sampled
                            negatives, log-Q corrected
``"sampled_softmax"``       :class:`RowSampledSoftmax`, ``k`` uniform negatives
                            per row
``"bce"``                   :class:`BCE`, ``k`` uniform negatives per row
==========================  ==================================================

A training step calls :func:`batch_loss` (``batch.py``): it keeps the
positions with a label, hands them to the configured loss (which draws its
negatives, if it samples, and scores them through the model's head) and
applies ``loss_normalization``. A new loss is a class following :class:`Loss`
in a module of its own here, and a name in ``LOSSES`` and ``build_loss``; the
task does not change. See ``docs/losses.md``.
"""

from __future__ import annotations

from .base import Loss, check_int, check_nonnegative
from .batch import NORMALIZATIONS, BatchLoss, batch_loss, check_normalization
from .chunked import ChunkedSoftmax, chunked_cross_entropy
from .full import FullSoftmax
from .per_row import BCE, RowSampledSoftmax
from .sampled import NEGATIVES, SampledSoftmax

LOSSES = ("ce", "bce", "sampled_softmax", "ce_chunked", "sampled_softmax_logq")


def build_loss(
    name: str,
    num_items: int,
    *,
    num_negatives: int = 100,
    temperature: float = 1.0,
    chunk: int = 4096,
    negatives: str = "popularity",
    popularity_alpha: float = 1.0,
) -> Loss:
    """The loss ``name`` (one of ``LOSSES``) with the task's options; each option is
    checked, and named in the error, whichever loss reads it."""
    check_int("num_negatives", num_negatives, 1)
    check_int("loss_chunk", chunk, 1)
    check_nonnegative("popularity_alpha", popularity_alpha)
    if negatives not in NEGATIVES:
        raise ValueError(f"negatives must be one of {NEGATIVES}, got {negatives!r}")
    if name == "ce":
        return FullSoftmax()
    if name == "ce_chunked":
        return ChunkedSoftmax(chunk)
    if name == "bce":
        return BCE(num_negatives)
    if name == "sampled_softmax":
        return RowSampledSoftmax(num_negatives, temperature)
    if name == "sampled_softmax_logq":
        return SampledSoftmax(num_items, num_negatives, negatives, popularity_alpha, temperature)
    raise ValueError(f"loss must be one of {LOSSES}, got {name!r}")


__all__ = [
    "BCE",
    "LOSSES",
    "NEGATIVES",
    "NORMALIZATIONS",
    "BatchLoss",
    "ChunkedSoftmax",
    "FullSoftmax",
    "Loss",
    "RowSampledSoftmax",
    "SampledSoftmax",
    "batch_loss",
    "build_loss",
    "check_normalization",
    "chunked_cross_entropy",
]
