"""The columnar :class:`InteractionLog`, its construction from rows, and k-core."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np

RawId = int | str

__all__ = ["InteractionLog", "RawId", "from_parts", "from_rows", "kcore_filter", "vocab_array"]

_INT64_MAX = 2**63 - 1


def vocab_array(values: Sequence[Any]) -> np.ndarray:
    """Raw ids as an array: ``int64`` when all are ints that fit, else ``object``."""
    if all(type(v) is int and 0 <= v <= _INT64_MAX for v in values):
        return np.fromiter(values, dtype=np.int64, count=len(values))
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


class InteractionLog:
    """Per-user chronological item sequences with raw ids, held as flat arrays.

    The log is columnar: ``item_codes`` index ``item_vocab`` (raw item ids),
    users back to back, user ``u`` owning
    ``item_codes[offsets[u]:offsets[u+1]]``, oldest first. ``user_vocab`` holds
    the raw user ids in order of first appearance in the file; ``times`` the
    parallel unix seconds (or ``None``). Raw ids are ``int`` for integer-id
    formats and ``str`` otherwise; vocabularies are ``int64`` arrays when every
    id fits, else ``object`` arrays. ``item_vocab`` may hold ids no longer used
    (after k-core); :attr:`num_items` counts the used ones.

    The list views :attr:`users`, :attr:`sequences` and :attr:`timestamps` are
    built on first access (for small logs and tests; at millions of rows use
    the arrays). ``InteractionLog(users, sequences, timestamps, source)`` builds
    a log from those lists.
    """

    def __init__(
        self,
        users: Sequence[RawId],
        sequences: Sequence[Sequence[RawId]],
        timestamps: Sequence[Sequence[int]] | None = None,
        source: str = "",
    ) -> None:
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        codes: dict[RawId, int] = {}
        flat = [codes.setdefault(i, len(codes)) for seq in sequences for i in seq]
        times = None
        if timestamps is not None:
            times = np.array([t for ts in timestamps for t in ts], dtype=np.int64)
        self._set(
            vocab_array(list(users)),
            vocab_array(list(codes)),
            np.array(flat, dtype=np.int64),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            times,
            source,
        )

    def _set(self, user_vocab, item_vocab, item_codes, offsets, times, source) -> None:  # type: ignore[no-untyped-def]
        if len(user_vocab) != len(offsets) - 1:
            raise ValueError("InteractionLog: one user id per sequence")
        if times is not None and len(times) != len(item_codes):
            raise ValueError("InteractionLog: one timestamp per interaction")
        self.user_vocab: np.ndarray = user_vocab
        self.item_vocab: np.ndarray = item_vocab
        self.item_codes: np.ndarray = item_codes
        self.offsets: np.ndarray = offsets
        self.times: np.ndarray | None = times
        self.source: str = source

    @classmethod
    def from_arrays(
        cls,
        user_vocab: np.ndarray,
        item_vocab: np.ndarray,
        item_codes: np.ndarray,
        offsets: np.ndarray,
        times: np.ndarray | None = None,
        source: str = "",
    ) -> InteractionLog:
        """A log from its arrays (see the class docstring), without copying them."""
        log = cls.__new__(cls)
        log._set(user_vocab, item_vocab, item_codes, offsets, times, source)
        return log

    @cached_property
    def users(self) -> list[RawId]:
        """Raw user ids, in order of first appearance in the file."""
        return self.user_vocab.tolist()  # type: ignore[no-any-return]

    @cached_property
    def sequences(self) -> list[list[RawId]]:
        """``sequences[u]``: user ``users[u]``'s raw item ids, oldest first."""
        flat = self.item_vocab[self.item_codes].tolist()
        return [flat[a:b] for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())]

    @cached_property
    def timestamps(self) -> list[list[int]] | None:
        """Parallel unix times per user, or ``None`` if the file has none."""
        if self.times is None:
            return None
        flat = self.times.tolist()
        return [flat[a:b] for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())]

    @property
    def num_users(self) -> int:
        """Number of users."""
        return len(self.user_vocab)

    @property
    def num_items(self) -> int:
        """Number of distinct raw item ids."""
        used = np.bincount(self.item_codes, minlength=len(self.item_vocab))
        return int(np.count_nonzero(used))

    @property
    def num_interactions(self) -> int:
        """Total number of interactions (duplicates counted)."""
        return len(self.item_codes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InteractionLog):
            return NotImplemented
        return (self.users, self.sequences, self.timestamps) == (
            other.users,
            other.sequences,
            other.timestamps,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"InteractionLog({self.num_users} users, {self.num_interactions} interactions, "
            f"source={self.source!r})"
        )


def from_rows(
    user_codes: np.ndarray,
    user_vocab: np.ndarray,
    item_codes: np.ndarray,
    item_vocab: np.ndarray,
    times: np.ndarray | None,
    order_key: np.ndarray | None,
    source: str,
) -> InteractionLog:
    """A log from rows in file order (codes of users numbered by first appearance).

    Rows are grouped by user; with ``order_key`` (the exact time, possibly
    fractional) each user is sorted by it, stably, so ties keep file order.
    ``times`` (whole seconds) is stored. ``n log n`` in the rows.
    """
    parts = {"user": user_codes, "item": item_codes}
    if times is not None:
        parts["time"] = times
    if order_key is not None:
        parts["key"] = order_key
    return from_parts(parts, user_vocab, item_vocab, source)


def from_parts(
    parts: dict[str, np.ndarray], user_vocab: np.ndarray, item_vocab: np.ndarray, source: str
) -> InteractionLog:
    """:func:`from_rows` of ``parts`` (``user``, ``item`` codes; optional ``time``, ``key``).

    ``parts`` is emptied as the log is built, so each input column is freed as
    soon as it has been used (when the caller holds no other reference): the
    peak is the sort order, the output columns and one input column."""
    user = parts.pop("user")
    counts = np.bincount(user, minlength=len(user_vocab))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    del counts
    order = _order(user, parts.pop("key", None))
    del user
    if order is not None and len(order) <= np.iinfo(np.int32).max:
        order = order.astype(np.int32)  # half the index memory while the columns are gathered
    times = parts.pop("time", None)  # the widest input first: its memory goes soonest
    stamps = None if times is None else _gather(times, order)
    del times
    items = _gather(parts.pop("item"), order)
    del order
    return InteractionLog.from_arrays(user_vocab, item_vocab, items, offsets, stamps, source)


_GATHER = 1 << 21  # rows gathered at a time (no full-size temporary of the input's dtype)


def _gather(values: np.ndarray, order: np.ndarray | None) -> np.ndarray:
    """``values[order]`` (or ``values``) as a contiguous ``int64`` array."""
    if order is None:
        return np.ascontiguousarray(values, dtype=np.int64)
    out = np.empty(len(order), dtype=np.int64)
    for a in range(0, len(order), _GATHER):
        out[a : a + _GATHER] = values[order[a : a + _GATHER]]
    return out


def _order(user: np.ndarray, key: np.ndarray | None) -> np.ndarray | None:
    """The stable order by (user, key), or ``None`` when the rows already are in it.

    Checking costs one pass; files grouped by user (MovieLens, S3-Rec-like
    dumps) then skip the sort, and time-ordered logs sort by user alone. Other
    integer keys are packed with the user into one ``int64`` and sorted once
    (a stable argsort: equal (user, time) keep file order); fractional or
    too wide keys are sorted by ``lexsort``."""
    same = user[1:] == user[:-1]
    grouped = bool(np.all(same | (user[1:] > user[:-1])))
    if key is None:
        return None if grouped else np.argsort(user, kind="stable")
    rising = key[1:] >= key[:-1]
    if grouped and bool(np.all(rising | ~same)):
        return None
    del same
    if bool(np.all(rising)):
        return np.argsort(user, kind="stable")
    del rising
    packed = _packed(user, key)
    if packed is not None:
        return np.argsort(packed, kind="stable")
    return np.lexsort((key, user))  # lexsort is stable


def _packed(user: np.ndarray, key: np.ndarray) -> np.ndarray | None:
    """``user * 2**b + (key - min key)`` as ``int64``, or ``None`` when it would not fit."""
    if key.dtype.kind not in "iu" or len(key) == 0 or int(user.min()) < 0:
        return None
    low = int(key.min())
    bits = (int(key.max()) - low).bit_length()
    if bits + int(user.max()).bit_length() > 62:
        return None
    packed = user.astype(np.int64)
    packed <<= bits
    packed += key
    packed -= low
    return packed


def kcore_filter(log: InteractionLog, k: int) -> InteractionLog:
    """Iterative k-core: keep users and items with >= ``k`` interactions until stable.

    Counts are interactions (a repeated item counts each time). Removing a
    user can push an item below ``k`` and vice versa, so both are recounted
    until a fixed point; the result is the unique maximal k-core. Order
    inside each kept sequence is unchanged. ``k <= 1`` returns ``log``.
    """
    if k <= 1:
        return log
    lengths = np.diff(log.offsets)
    user = np.repeat(np.arange(len(lengths)), lengths)
    keep = _kcore_mask(user, log.item_codes, k)
    counts = np.bincount(user[keep], minlength=len(lengths))
    kept = counts > 0
    offsets = np.concatenate([[0], np.cumsum(counts[kept])]).astype(np.int64)
    times = None if log.times is None else log.times[keep]
    return InteractionLog.from_arrays(
        log.user_vocab[kept], log.item_vocab, log.item_codes[keep], offsets, times, log.source
    )


def _kcore_mask(user: np.ndarray, item: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of interactions in the k-core (fixed-point iteration)."""
    keep = np.ones(len(user), dtype=bool)
    while True:
        ucount = np.bincount(user[keep], minlength=user.max(initial=0) + 1)
        icount = np.bincount(item[keep], minlength=item.max(initial=0) + 1)
        new = keep & (ucount[user] >= k) & (icount[item] >= k)
        if (new == keep).all():
            return keep
        keep = new
