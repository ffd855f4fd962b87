"""Training-row samplers: length-bucketed, epoch-seeded, sharded over DDP processes."""

from __future__ import annotations

import numpy as np
from torch.utils.data import DistributedSampler, Sampler

__all__ = ["DistributedLengthBucketSampler", "LengthBucketSampler"]


class LengthBucketSampler(Sampler[int]):
    """Shuffled indices in which each run of ``batch_size`` has similar lengths.

    Indices are shuffled, cut into pools of ``batch_size * pool_batches``, each
    pool is sorted by length and cut into batches, and the full batches are
    shuffled (a short one, at most one an epoch, comes last, so that the
    batches of a process stay aligned with the buckets). A batch then trims to
    its longest row (most histories are short, so padding to ``max_len`` wastes
    most of the compute); every row is still
    seen once an epoch. The order changes every epoch (``seed + epoch``;
    ``set_epoch`` pins it, as ``DistributedSampler``'s does). ``pool_batches=1``
    is a plain shuffle (each batch is a random chunk of the permutation).
    Bucketed batches differ in their number of targets (a batch of long
    histories holds many times those of a batch of short ones): a loss
    averaged over each batch's targets then weighs targets unequally, so
    divide the summed loss by the rows (``SequentialRecommendation``'s
    default ``loss_normalization="rows"``).

    Sharded over ``num_replicas`` processes, the global batches of
    ``batch_size * num_replicas`` rows are formed exactly as one process with
    that batch size would form them; rank ``r`` takes every ``num_replicas``-th
    index from ``r`` (``DistributedSampler``'s layout, padded by repeating the
    first indices), so its ``i``-th batch is its share of global batch ``i``:
    N processes with batch ``b`` see the same global batches as one with ``N*b``.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        seed: int = 0,
        pool_batches: int = 50,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if batch_size < 1 or pool_batches < 1 or num_replicas < 1:
            raise ValueError("need batch_size, pool_batches, num_replicas >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.lengths, self.batch_size = np.asarray(lengths), batch_size
        self.num_replicas, self.rank = num_replicas, rank
        global_batch = batch_size * num_replicas
        self.seed, self.pool, self.epoch = seed, global_batch * pool_batches, 0
        self.global_batch = global_batch
        # DistributedSampler's public attributes (read by some tools)
        self.shuffle, self.drop_last = True, False
        self.num_samples = -(-len(self.lengths) // num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this before each epoch, so a resumed run sees the same order."""
        self.epoch = epoch

    def global_order(self, epoch: int) -> np.ndarray:
        """All ranks' indices of ``epoch``, before sharding and padding."""
        rng = np.random.default_rng(self.seed + epoch)
        order = rng.permutation(len(self.lengths))
        batches = []
        for start in range(0, len(order), self.pool):
            pool = order[start : start + self.pool]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]
            batches += [
                pool[i : i + self.global_batch] for i in range(0, len(pool), self.global_batch)
            ]
        if not batches:
            return order
        # the one short batch (the end of the last pool) goes last: shuffled in, it would
        # shift every later batch off the bucket boundaries (results/perf/notes.md)
        full = [x for x in batches if len(x) == self.global_batch]
        short = [x for x in batches if len(x) < self.global_batch]
        return np.concatenate([full[b] for b in rng.permutation(len(full))] + short)

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = self.global_order(self.epoch)
        self.epoch += 1  # a plain loop over epochs still reshuffles
        if self.num_replicas > 1:
            order = np.resize(order, self.total_size)[self.rank :: self.num_replicas]
        yield from order.tolist()


class DistributedLengthBucketSampler(LengthBucketSampler, DistributedSampler):
    """``LengthBucketSampler`` for one rank of several.

    Being a ``DistributedSampler``, Lightning neither wraps it again nor
    shuffles its indices, and calls its ``set_epoch`` itself (a wrapped sampler
    would never see ``set_epoch``, so a resumed run would replay epoch 0's order).
    """
