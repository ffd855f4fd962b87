"""What a recommendation returns: one list per history, and the error for a history
with no known item (``Recommender.recommend``; the server answers with the same fields)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Recommendation", "UnknownItemsError"]


@dataclass(frozen=True)
class Recommendation:
    """The next items for one history, best first.

    Attributes:
        items: raw item ids, ``k`` of them (fewer only when ``exclude_seen``
            leaves fewer than ``k`` items to recommend).
        scores: the model's score (logit) of each item, same length; for a cold
            user the log-probability of the item under the training popularity.
        confidence: one float for the whole list, higher = a hit more likely. With a
            calibrated checkpoint (``Recommender.calibration``; ``python -m
            bft_lightning calibrate``) it is the probability that the user's next
            item is among the first ``calibration.k`` listed; without one, the
            model's raw signal (``docs/confidence.md``): for ``precision="off"``
            the list's softmax mass in [0, 1], for ``precision="on"`` the filter's
            normalised final log precision (unbounded).
        unknown: ids of the history the checkpoint has never seen (skipped).
        cold: True when the history was empty (popularity, see ``recommend``).
    """

    items: list[str]
    scores: list[float]
    confidence: float
    unknown: tuple[str, ...] = field(default=())
    cold: bool = False


class UnknownItemsError(ValueError):
    """A non-empty history none of whose item ids the checkpoint knows."""

    def __init__(self, position: int, ids: Sequence[str]) -> None:
        self.position, self.ids = position, tuple(ids)
        shown = ", ".join(repr(i) for i in self.ids[:5]) + (", ..." if len(self.ids) > 5 else "")
        super().__init__(
            f"history {position}: none of its {len(self.ids)} item ids is known to the "
            f"checkpoint ({shown})"
        )
