"""What a loss is: the protocol every training loss of the recommendation task follows.

A training step encodes a batch, keeps the positions that have a label, and
hands the loss the model, those states and their targets. The loss scores the
candidates it needs through the model's head (``output_transform``,
``item_weights``, ``output_bias``, ``output_scale``) and returns the mean over
the targets. Negative sampling, when a loss samples, lives inside the loss.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from torch import Tensor

from bft_lightning.models.base import SequentialRecommender


@runtime_checkable
class Loss(Protocol):
    """``loss(model, hidden, target, log_prec) -> scalar``, the mean over the ``N`` targets.

    Args of ``__call__``:
        model: the recommender whose head scores items.
        hidden: ``(N, d)`` states that have a label.
        target: ``(N,)`` item ids in ``1..num_items``.
        log_prec: ``(N, G)`` final log-precision, or None (``precision="off"``).

    ``needs_item_frequency`` says whether the loss reads training item counts;
    the task then hands them over once through ``set_item_frequency`` (a
    ``(num_items + 1,)`` tensor, index 0 the padding).
    """

    needs_item_frequency: bool

    def __call__(
        self,
        model: SequentialRecommender,
        hidden: Tensor,
        target: Tensor,
        log_prec: Tensor | None,
    ) -> Tensor: ...

    def set_item_frequency(self, frequency: Tensor) -> None: ...


class NoFrequency:
    """Mixin of the losses that read no item counts."""

    needs_item_frequency = False

    def set_item_frequency(self, frequency: Tensor) -> None:
        """Ignored: this loss does not sample by popularity."""


def check_int(name: str, value: object, low: int) -> int:
    """An integer option ``>= low``; the message names the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def check_nonnegative(name: str, value: object) -> float:
    """A finite number ``>= 0``; the message names the option."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)
