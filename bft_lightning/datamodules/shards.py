"""Per-rank shards of users: each DDP process builds and serves only its users' rows.

``SequenceDataModule(shard_users=True)`` under ``N`` processes gives rank ``r``
a contiguous range of users, cut so that every rank holds about ``1/N`` of the
interactions (:func:`user_bounds`). The padded training rows (the bulk of the
memory: rows x (max_len + 1)) and the validation / test rows are built for
those users only; the flat interaction arrays are the memory-mapped cache,
shared by the processes of a host, of which a rank touches the pages of its
own users' items (plus one pass for the item counts).

- Training: :class:`ShardBucketSampler` buckets the rank's rows by length
  and pads its epoch (repeating its first rows) to the longest shard's, so
  every rank runs the same number of steps (DDP's gradient all-reduce needs
  that). A global batch is then ``N`` local batches of different users: the
  same expectation as one process's batches, not the same batches.
- Evaluation: :class:`EvalShard` keeps the global row numbering (``user`` is
  the row of the whole evaluation set, ``len`` its size), and
  :class:`ShardSampler` serves the rank's rows once each, so the ranking
  metric, which all-reduces per-user states, counts every user exactly once
  and equals the one-process metric.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch.utils.data import Dataset, DistributedSampler

from .arrays import ArrayDataset
from .sampling import LengthBucketSampler
from .splits import LeaveOneOut, SequenceData, eval_arrays, train_arrays
from .windows import PrefixRows

__all__ = [
    "EvalShard",
    "ShardBucketSampler",
    "ShardSampler",
    "shard_dataset",
    "shard_rows",
    "shard_split",
    "user_bounds",
]


def user_bounds(offsets: np.ndarray, world: int) -> np.ndarray:
    """``(world + 1,)`` user boundaries: rank ``r`` owns users ``[b[r], b[r+1])``.

    Contiguous ranges holding about ``1 / world`` of the interactions each
    (cut where the cumulative count crosses ``r / world`` of the total); every
    user belongs to exactly one rank."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    users = len(offsets) - 1
    total = int(offsets[-1])
    cuts = np.searchsorted(offsets, [total * r / world for r in range(1, world)], side="left")
    bounds = np.concatenate([[0], np.clip(cuts, 0, users), [users]]).astype(np.int64)
    return np.maximum.accumulate(bounds)


def shard_split(split: LeaveOneOut, lo: int, hi: int) -> LeaveOneOut:
    """``split`` restricted to users ``[lo, hi)``: other users train nothing and are not evaluated.

    User indices stay global; the item counts stay those of every user (the
    loss's popularity sampler and the metric's strata must agree over ranks)."""
    users = np.arange(len(split.train_start))
    mine = (users >= lo) & (users < hi)
    return LeaveOneOut(
        train_start=split.train_start,
        train_end=np.where(mine, split.train_end, split.train_start),
        eval_users=split.eval_users[(split.eval_users >= lo) & (split.eval_users < hi)],
        item_frequency=split.item_frequency,
        num_short_users=split.num_short_users,
        num_untrainable_users=split.num_untrainable_users,
    )


def shard_rows(
    data: SequenceData, split: LeaveOneOut, world: int, prefix: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``(training rows per rank, first evaluation row per rank and the total)``.

    ``prefix``: rows are training targets (``train_rows="prefix"``), else
    trainable users. Computed on every rank from the shared arrays (no
    communication), so all ranks agree on the epoch length and the numbering."""
    bounds = user_bounds(data.offsets, world)
    length = split.train_end - split.train_start
    rows = np.where(length >= 2, length - 1 if prefix else 1, 0)
    per_user = np.concatenate([[0], np.cumsum(rows)])
    train = per_user[bounds[1:]] - per_user[bounds[:-1]]
    eval_start = np.searchsorted(split.eval_users, bounds)
    return train.astype(np.int64), eval_start.astype(np.int64)


def shard_dataset(
    name: str,
    data: SequenceData,
    split: LeaveOneOut,
    max_len: int,
    prefix: bool,
    world: int,
    rank: int,
) -> ArrayDataset | PrefixRows | EvalShard:
    """Rank ``rank``'s ``train`` / ``val`` / ``test`` rows (see the module docstring)."""
    bounds = user_bounds(data.offsets, world)
    mine = shard_split(split, int(bounds[rank]), int(bounds[rank + 1]))
    if name == "train":
        if prefix:
            return PrefixRows(data, mine, max_len)
        return ArrayDataset(train_arrays(data, mine, max_len))
    start = int(np.searchsorted(split.eval_users, bounds[rank]))
    arrays = eval_arrays(data, mine, max_len, name)
    arrays["user"] = arrays["user"] + start  # the row in the whole evaluation set
    return EvalShard(arrays, start, len(split.eval_users))


def epoch_rows(dm: Any, world: int) -> int:
    """The longest shard's training rows: every rank's epoch length."""
    train, _ = shard_rows(dm.sequences, dm.split, world, dm.train_rows == "prefix")
    return int(train.max())


class EvalShard(Dataset):
    """Rows ``[start, start + len(arrays))`` of an evaluation set of ``total`` rows.

    ``len`` is the whole set's (the ranking metric sizes its per-user state by
    it); indices are global rows, and only this rank's are held."""

    def __init__(self, arrays: dict[str, np.ndarray], start: int, total: int) -> None:
        self.arrays, self.start, self.total = arrays, int(start), int(total)
        self.stop = self.start + len(next(iter(arrays.values())))

    def __len__(self) -> int:
        return self.total

    def __getitems__(self, indices: list[int]) -> dict[str, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (idx.min() < self.start or idx.max() >= self.stop):
            raise IndexError(f"rows outside this rank's shard [{self.start}, {self.stop})")
        local = idx - self.start
        return {k: v[local] for k, v in self.arrays.items()}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v[0] for k, v in self.__getitems__([int(index)]).items()}


class ShardSampler(DistributedSampler):
    """Rows ``[start, stop)`` in order: this rank's evaluation shard, each row once.

    A ``DistributedSampler``, so that Lightning does not shard the rows again."""

    def __init__(self, start: int, stop: int, num_replicas: int, rank: int) -> None:
        self.start, self.stop = int(start), int(stop)
        self.num_replicas, self.rank, self.epoch = num_replicas, rank, 0
        self.shuffle, self.drop_last, self.seed = False, False, 0
        self.num_samples = self.stop - self.start
        self.total_size = self.num_samples

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.num_samples


class ShardBucketSampler(LengthBucketSampler, DistributedSampler):
    """A :class:`LengthBucketSampler` over this rank's rows, padded to ``num_samples``.

    ``num_samples`` is the longest shard's row count: the epoch repeats this
    rank's first rows (of the epoch's order) to reach it, so all ranks take
    the same number of steps. Seeded with ``seed + rank`` (shards differ)."""

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        num_samples: int,
        seed: int = 0,
        pool_batches: int = 50,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(lengths, batch_size, seed + rank, pool_batches)
        if num_samples < len(self.lengths) or len(self.lengths) == 0:
            raise ValueError(
                f"rank {rank}: {len(self.lengths)} training rows, num_samples {num_samples}"
            )
        self.num_replicas, self.rank = num_replicas, rank
        self.num_samples, self.total_size = num_samples, num_samples * num_replicas

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = self.global_order(self.epoch)
        self.epoch += 1
        yield from np.resize(order, self.num_samples).tolist()
