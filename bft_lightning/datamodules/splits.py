"""Id remapping, leave-one-out splits and left-padded batch arrays.

Pipeline: :func:`encode` turns an :class:`~.readers.InteractionLog` into
:class:`SequenceData` (flat ``int64`` arrays, items renumbered ``1..num_items``
in order of first appearance, ``0`` = padding); :func:`leave_one_out` splits
each user; :func:`train_arrays` / :func:`eval_arrays` build the padded arrays
the DataModule serves.

Leave-one-out rules (per user with ``n`` items ``i_0 .. i_{n-1}``):

- ``n >= 3``: training part ``i_0 .. i_{n-3}``; validation predicts ``i_{n-2}``
  from ``i_0 .. i_{n-3}``; test predicts ``i_{n-1}`` from ``i_0 .. i_{n-2}``.
- ``n < 3`` ("short" users): all ``n`` items are training data, the user is
  never evaluated. They are counted in ``LeaveOneOut.num_short_users``.
- A training part of one item has no next-item target; such users add to
  ``item_frequency`` but get no training row (counted in
  ``LeaveOneOut.num_untrainable_users``).
- ``item_frequency`` counts every item of every training part (not only the
  served window); validation and test targets are never counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .readers import InteractionLog

__all__ = [
    "LeaveOneOut",
    "SequenceData",
    "check_enough",
    "encode",
    "eval_arrays",
    "leave_one_out",
    "left_pad",
    "predict_arrays",
    "repeat_rate",
    "train_arrays",
]


@dataclass(frozen=True)
class SequenceData:
    """Remapped interaction sequences as flat arrays.

    Attributes:
        items: ``(N,)`` int64 item ids in ``1..num_items``, users back to back.
        offsets: ``(U+1,)`` int64; user ``u`` owns ``items[offsets[u]:offsets[u+1]]``.
        times: ``(N,)`` int64 unix seconds aligned with ``items``, or ``None``.
        num_items: number of distinct items (``0`` is padding, not counted).
        user_ids: ``(U,)`` raw user ids as strings.
        item_ids: ``(num_items+1,)`` raw item ids as strings, ``item_ids[0] == ""``.
    """

    items: np.ndarray
    offsets: np.ndarray
    times: np.ndarray | None
    num_items: int
    user_ids: np.ndarray
    item_ids: np.ndarray

    @property
    def num_users(self) -> int:
        """Number of users."""
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """``(U,)`` sequence length per user."""
        return np.diff(self.offsets)


def encode(log: InteractionLog) -> SequenceData:
    """Renumber items ``1..num_items`` in order of first appearance.

    Users are scanned in log order and items in sequence order, so the first
    item of the first user becomes ``1``. Users keep their log order.
    Vectorised over the log's arrays (no loop over interactions).
    """
    codes = log.item_codes
    n = len(codes)
    first = np.full(len(log.item_vocab), n, dtype=np.int64)
    np.minimum.at(first, codes, np.arange(n, dtype=np.int64))
    used = np.flatnonzero(first < n)
    by_appearance = used[np.argsort(first[used], kind="stable")]
    renumber = np.zeros(len(log.item_vocab), dtype=np.int64)
    renumber[by_appearance] = np.arange(1, len(by_appearance) + 1, dtype=np.int64)
    return SequenceData(
        items=renumber[codes],
        offsets=np.asarray(log.offsets, dtype=np.int64),
        times=None if log.times is None else np.asarray(log.times, dtype=np.int64),
        num_items=len(by_appearance),
        user_ids=_strings(log.user_vocab),
        item_ids=np.concatenate([np.array([""]), _strings(log.item_vocab[by_appearance])]),
    )


def _strings(ids: np.ndarray) -> np.ndarray:
    """Raw ids as a numpy string array (``str`` of each)."""
    if len(ids) == 0:
        return np.array([], dtype=str)
    return ids.astype(str)


@dataclass(frozen=True)
class LeaveOneOut:
    """Per-user boundaries of the leave-one-out split (indices into ``items``).

    Attributes:
        train_start: ``(U,)`` first index of each user's training part.
        train_end: ``(U,)`` one past its last index.
        eval_users: ``(E,)`` users with >= 3 items, in user order; row ``r`` of
            the validation and test sets is user ``eval_users[r]``.
        item_frequency: ``(num_items+1,)`` int64 training counts; ``[0] == 0``.
        num_short_users: users with fewer than 3 items (training only).
        num_untrainable_users: users whose training part has < 2 items.
    """

    train_start: np.ndarray
    train_end: np.ndarray
    eval_users: np.ndarray
    item_frequency: np.ndarray
    num_short_users: int
    num_untrainable_users: int


def leave_one_out(data: SequenceData) -> LeaveOneOut:
    """Split every user: last item = test, second-last = validation, rest = train."""
    start, lengths = data.offsets[:-1], data.lengths
    short = lengths < 3
    end = np.where(short, data.offsets[1:], data.offsets[1:] - 2)
    in_train = np.zeros(len(data.items) + 1, dtype=np.int64)
    np.add.at(in_train, start, 1)
    np.add.at(in_train, end, -1)
    mask = np.cumsum(in_train)[:-1] > 0
    freq = np.bincount(data.items[mask], minlength=data.num_items + 1).astype(np.int64)
    return LeaveOneOut(
        train_start=start.copy(),
        train_end=end,
        eval_users=np.flatnonzero(~short),
        item_frequency=freq,
        num_short_users=int(short.sum()),
        num_untrainable_users=int(((end - start) < 2).sum()),
    )


def repeat_rate(data: SequenceData, split: LeaveOneOut) -> float:
    """Share of the training targets already in their own history: the items of a
    user's training part after its first that the user had before in that part.

    A user's repeats are the occurrences of a (user, item) pair beyond its first,
    so this is ``(training items - distinct training pairs) / training targets``,
    vectorised over all users. Near 0 (Amazon reviews: a product is reviewed once)
    says a recommendation of a seen item is wasted; a high rate (re-orders, music)
    says seen items must stay eligible. 0.0 when there is no training target.
    """
    lengths = split.train_end - split.train_start
    has = lengths > 0
    targets = int(lengths[has].sum() - has.sum())
    if targets <= 0:
        return 0.0
    users = np.repeat(np.arange(len(lengths), dtype=np.int64), np.maximum(lengths, 0))
    idx = np.repeat(split.train_start - np.cumsum(lengths) + lengths, np.maximum(lengths, 0))
    idx = idx + np.arange(len(users), dtype=np.int64)
    pairs = users * (int(data.num_items) + 1) + data.items[idx]
    return float(len(pairs) - len(np.unique(pairs))) / targets


def left_pad(values: np.ndarray, start: np.ndarray, end: np.ndarray, width: int) -> np.ndarray:
    """Rows ``values[max(start, end-width):end]`` right-aligned in ``width`` columns.

    Vectorised over rows; positions before ``start`` are ``0`` (left padding),
    so a row longer than ``width`` keeps its most recent ``width`` values.
    Returns ``(R, width)`` int64.
    """
    idx = end[:, None] - width + np.arange(width)[None, :]  # (R, width)
    valid = idx >= start[:, None]
    return np.where(valid, values[np.clip(idx, 0, max(len(values) - 1, 0))], 0).astype(np.int64)


def train_arrays(
    data: SequenceData, split: LeaveOneOut, max_len: int, rows: str = "user"
) -> dict[str, np.ndarray]:
    """Training rows: ``seq`` ``(R, max_len+1)``, ``user`` ``(R,)``, ``seq_time``.

    Only users whose training part has >= 2 items get rows; ``user`` is the
    0-based user index in ``data``, ``seq_time`` (0 at padding) comes with
    timestamps. Rows are left-padded with 0.

    - ``rows="user"``: one row per user, its most recent ``max_len + 1``
      training items; every position predicts the next item.
    - ``rows="prefix"``: one row per training target, as RecBole and the
      original SASRec data augmentation serve them: for a training part
      ``i_0 .. i_m`` the rows end at ``i_1, .., i_m`` (each the most recent
      ``max_len + 1`` items up to there) and an extra key ``num_targets``
      ``(R,)`` (all 1) tells the model that only the row's last item is a
      target. The same targets as ``"user"`` (plus those cut off by
      ``max_len`` in long histories), each in its own row: about
      ``mean training length / 2`` times the rows' memory (int64). The
      DataModule serves the same rows through :class:`~.windows.PrefixRows`,
      which cuts them per batch instead of materialising them.
    """
    if rows not in ("user", "prefix"):
        raise ValueError(f"rows must be 'user' or 'prefix', got {rows!r}")
    users = np.flatnonzero(split.train_end - split.train_start >= 2)
    start, end = split.train_start[users], split.train_end[users]
    extra: dict[str, np.ndarray] = {}
    if rows == "prefix":
        count = end - start - 1  # targets i_1 .. i_m of each user
        first = np.cumsum(count) - count  # each user's first row
        step = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)
        users, start = np.repeat(users, count), np.repeat(start, count)
        end = start + 2 + step  # one past the row's target
        extra["num_targets"] = np.ones(len(users), dtype=np.int64)
    out = {"seq": left_pad(data.items, start, end, max_len + 1), "user": users.astype(np.int64)}
    if data.times is not None:
        out["seq_time"] = left_pad(data.times, start, end, max_len + 1)
    return out | extra


def eval_arrays(
    data: SequenceData, split: LeaveOneOut, max_len: int, stage: str
) -> dict[str, np.ndarray]:
    """Validation or test rows for the users in ``split.eval_users``.

    ``stage="val"``: history ``items[:-2]``, target ``items[-2]``;
    ``stage="test"``: history ``items[:-1]``, target ``items[-1]``. Keys:
    ``input_ids (E, max_len)`` left-padded, ``target (E,)``, ``user (E,)`` (row
    index in the eval set), ``history_len (E,)`` (untruncated), and with
    timestamps ``input_time (E, max_len)`` and ``target_time (E,)``.
    """
    if stage not in ("val", "test"):
        raise ValueError(f"stage must be 'val' or 'test', got {stage!r}")
    users = split.eval_users
    start = data.offsets[users]
    target_pos = data.offsets[users + 1] - (2 if stage == "val" else 1)
    out = {
        "input_ids": left_pad(data.items, start, target_pos, max_len),
        "target": data.items[target_pos],
        "user": np.arange(len(users), dtype=np.int64),
        "history_len": (target_pos - start).astype(np.int64),
    }
    if data.times is not None:
        out["input_time"] = left_pad(data.times, start, target_pos, max_len)
        out["target_time"] = data.times[target_pos]
    return out


def predict_arrays(data: SequenceData, max_len: int) -> dict[str, np.ndarray]:
    """Every user's whole history, to recommend what comes after it.

    Keys: ``input_ids (U, max_len)`` (the most recent ``max_len`` items,
    left-padded), ``user (U,)`` (the 0-based user index in ``data``, every
    user, short ones included), ``history_len (U,)`` (untruncated), and with
    timestamps ``input_time (U, max_len)``.
    """
    start, end = data.offsets[:-1], data.offsets[1:]
    out = {
        "input_ids": left_pad(data.items, start, end, max_len),
        "user": np.arange(data.num_users, dtype=np.int64),
        "history_len": (end - start).astype(np.int64),
    }
    if data.times is not None:
        out["input_time"] = left_pad(data.times, start, end, max_len)
    return out


def check_enough(data: SequenceData, split: LeaveOneOut, source: str) -> None:
    """Refuse data too small for leave-one-out training and evaluation."""
    longest = int(data.lengths.max()) if data.num_users else 0
    if len(split.eval_users) == 0:
        raise ValueError(
            f"{source}: no user has >= 3 interactions ({data.num_users} users, longest history "
            f"{longest}); leave-one-out holds out each user's last two items for validation and "
            "test, so at least one user needs 3"
        )
    trainable = (split.train_end - split.train_start) >= 2
    if not trainable.any():
        raise ValueError(
            f"{source}: no training rows ({data.num_users} users, longest history {longest}); a "
            "user trains with 2 items, or with >= 4 (the last two are held out), so at least "
            "one user needs 2 or >= 4 interactions"
        )
