"""Noisy training histories: a share of the training items replaced by random ones.

The research question of ``docs/spec.md`` (precision discounts untrustworthy
tokens) is tested directly by corrupting the data the model learns from while
keeping what it is judged on clean. :func:`corrupt_training_items` replaces
exactly ``round(rate * M)`` of the ``M`` training-part items (every item
except each evaluated user's validation and test targets, the last two; see
:mod:`.splits`) by an item drawn uniformly from the other ``num_items - 1``.
The positions are a uniform sample without replacement, both draws from
``numpy.random.default_rng(seed)``: the same data, rate and seed give the same
corruption on every process and every run (a checkpoint tested later sees
the histories it was trained on).

Validation and test targets stay clean; their inputs are the corrupted
training part (the user's logged history is what is noisy), and the test
input's last item (the validation target) is clean.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .splits import SequenceData, leave_one_out

__all__ = ["corrupt_training_items", "training_positions"]


def training_positions(data: SequenceData) -> np.ndarray:
    """``(M,)`` int64 indices into ``data.items`` of every training-part item.

    The training parts of :func:`~.splits.leave_one_out`, concatenated in order.
    """
    split = leave_one_out(data)
    n = split.train_end - split.train_start  # (U,)
    first = np.cumsum(n) - n  # (U,) where each user's part starts in the output
    return np.arange(int(n.sum()), dtype=np.int64) + np.repeat(split.train_start - first, n)


def corrupt_training_items(
    data: SequenceData, rate: float, seed: int = 0
) -> tuple[SequenceData, np.ndarray]:
    """``data`` with ``round(rate * M)`` training items replaced; and the ``(N,)`` bool mask.

    Each replaced item differs from the one it replaces (drawn from the other
    ``num_items - 1`` items, uniformly). ``rate == 0`` returns ``data`` itself.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"train_noise must be in [0, 1], got {rate!r}")
    mask = np.zeros(len(data.items), dtype=bool)
    if rate == 0.0:
        return data, mask
    if data.num_items < 2:
        raise ValueError(f"train_noise needs at least 2 items, got {data.num_items}")
    eligible = training_positions(data)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(eligible, size=int(round(rate * len(eligible))), replace=False))
    original = data.items[chosen]
    # uniform over 1..num_items without the original: draw from num_items - 1, skip it
    draw = rng.integers(1, data.num_items, size=len(chosen), dtype=np.int64)
    items = data.items.copy()
    items[chosen] = draw + (draw >= original)
    mask[chosen] = True
    return replace(data, items=items), mask
