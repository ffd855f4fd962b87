"""Histories in a checkpoint's indices, their timestamps, and left-padded batches of them.

A history is its items oldest first and, optionally, one timestamp per item
(unix seconds, as in the training data). HSTU reads the timestamps (its
attention's learned time bias); SASRec and BERT4Rec do not (``docs/recommend.md``,
Timestamps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["EncodedHistory", "left_pad", "pad_times", "timestamp"]


class EncodedHistory(NamedTuple):
    """A history in the checkpoint's indices (``Recommender.encode``).

    items: known item indices, oldest first; unknown: the raw ids skipped;
    times: the known items' timestamps (whole unix seconds), or None (none
    given, or a model that does not read them).
    """

    items: list[int]
    unknown: tuple[str, ...]
    times: list[int] | None = None


def timestamp(value: object, position: int, j: int) -> int:
    """A timestamp as whole seconds, ``int(value)`` (as the data readers store them)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(
            f"history {position}, time {j}: expected a number (unix seconds), got {value!r}"
        )
    number = float(value)
    if not math.isfinite(number) or abs(number) >= 2**62:
        raise ValueError(f"history {position}, time {j}: expected a finite number, got {value!r}")
    return int(value)


def check_times(times: object, length: int, position: int) -> list[int]:
    """``times`` of one history of ``length`` items as whole seconds; ``ValueError``
    naming the history ``position`` when it is not a list of numbers of that length."""
    if isinstance(times, str | bytes) or not isinstance(times, Sequence | np.ndarray):
        raise ValueError(
            f"history {position}: times must be a list of numbers, got {type(times).__name__}"
        )
    if len(times) != length:
        raise ValueError(
            f"history {position}: {len(times)} times for {length} items (one timestamp per item)"
        )
    return [timestamp(t, position, j) for j, t in enumerate(times)]


def left_pad(rows: Sequence[Sequence[int]], width: int) -> Tensor:
    """(N, width) long: each row's last ``width`` values, right-aligned, 0 before them."""
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        tail = list(row)[-width:]
        if tail:
            out[r, width - len(tail) :] = torch.tensor(tail, dtype=torch.long)
    return out


def pad_times(rows: Sequence[EncodedHistory], width: int) -> Tensor | None:
    """(N, width) left-padded timestamps (0 at padding, as the DataModule's), or None
    when no row has times. A batch that mixes rows with and without times is
    refused: the model would read some with its time bias and some without."""
    timed = [r.times is not None for r in rows]
    if not any(timed):
        return None
    if not all(timed):
        raise ValueError("a batch mixes histories with and without times: give times for all")
    return left_pad([r.times or [] for r in rows], width)
