"""``train_rows="prefix"`` served on the fly: one row per training target, built per batch.

:func:`~.splits.train_arrays` with ``rows="prefix"`` materialises every row:
``(targets, max_len + 1)`` int64, about 34 GB at 20M interactions with
``max_len=200``. :class:`PrefixRows` holds only per-user boundaries (``O(users)``)
and the shared flat arrays, and cuts each batch's windows when the DataLoader
asks for it, so its memory is that of the interactions themselves. The rows,
their order and their content are exactly those of ``train_arrays``.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset

from .splits import LeaveOneOut, SequenceData, left_pad

__all__ = ["PrefixRows"]


class PrefixRows(Dataset):
    """Prefix training rows of ``data``, cut on demand (see the module docstring).

    Row ``r`` belongs to user ``u`` (the users whose training part has >= 2
    items, in order) and ends at that user's ``k``-th target: ``seq`` is the
    most recent ``max_len + 1`` items up to and including it, left-padded with
    0; ``user``, ``num_targets`` (1) and, with timestamps, ``seq_time`` come
    with it, as in :func:`~.splits.train_arrays`.
    """

    def __init__(self, data: SequenceData, split: LeaveOneOut, max_len: int) -> None:
        self.items, self.times, self.width = data.items, data.times, max_len + 1
        users = np.flatnonzero(split.train_end - split.train_start >= 2)
        self.users = users.astype(np.int64)
        self.start = split.train_start[users].astype(np.int64)
        count = split.train_end[users] - self.start - 1  # targets i_1 .. i_m of each user
        self.first = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)  # (U'+1,)

    def __len__(self) -> int:
        return int(self.first[-1])

    def _bounds(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(user index, start, end)`` of each row (end: one past its target)."""
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"row index out of range [0, {len(self)})")
        k = np.searchsorted(self.first, rows, side="right") - 1
        start = self.start[k]
        return self.users[k], start, start + 2 + (rows - self.first[k])

    def __getitems__(self, indices: list[int]) -> dict[str, np.ndarray]:
        rows = np.asarray(indices, dtype=np.int64)
        users, start, end = self._bounds(rows)
        out = {
            "seq": left_pad(self.items, start, end, self.width),
            "user": users,
            "num_targets": np.ones(len(rows), dtype=np.int64),
        }
        if self.times is not None:
            out["seq_time"] = left_pad(self.times, start, end, self.width)
        return out

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v[0] for k, v in self.__getitems__([int(index)]).items()}

    def row_lengths(self) -> np.ndarray:
        """``(R,)`` items in each row (its padded width minus the padding)."""
        users, start, end = self._bounds(np.arange(len(self), dtype=np.int64))
        return np.minimum(end - start, self.width)
