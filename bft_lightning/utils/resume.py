"""Exact mid-epoch resume: a resumable training loader and per-batch seeding.

What a resumed run needs to repeat an uninterrupted one exactly:

1. weights, optimizer, scheduler, loop counters: Lightning's checkpoint;
2. the epoch's sample order: a sampler seeded by ``seed + epoch`` that
   Lightning pins with ``set_epoch`` (``LengthBucketSampler``);
3. the position inside the epoch: :class:`ResumableDataLoader` (Lightning saves
   its ``state_dict`` in the checkpoint and hands it back on resume; a plain
   ``DataLoader`` restarts the epoch from its first batch, with a warning);
4. the random numbers of each step (dropout, sampled negatives): :class:`StepSeed`;
5. a checkpoint between validations: :class:`LastCheckpoint` (``last.ckpt``
   on a step interval and at each epoch's end).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

__all__ = ["LastCheckpoint", "ResumableDataLoader", "StepSeed", "sweep_temporary_files"]


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that resumes in the middle of an epoch.

    It counts the batches handed out in the current pass. Lightning stores
    ``state_dict()`` (``{"batches": k}``) in every checkpoint and, when it
    resumes mid-epoch, calls ``load_state_dict`` before iterating: the next pass
    then skips the first ``k`` batches of the (re-created, identical) epoch
    order, and its count continues from ``k``, so a second interruption in the
    same epoch resumes correctly too. A checkpoint saved on an epoch's last
    batch skips nothing: the next pass is a new epoch. That is told by the
    sampler's epoch (``set_epoch``), stored with the count, so it holds when an
    epoch ends before the loader does (``limit_train_batches``); for a sampler
    without one, by ``k >= len(self)``.

    Skipped batches are loaded and dropped (cheap for in-memory datasets), so
    the sampler must give the same order again: seed it by epoch and let
    Lightning call ``set_epoch``. The count is exact because Lightning does not
    pre-fetch from loaders with a length (the default for map-style datasets).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches = 0
        self._skip = 0
        self._epoch: int | None = None  # the sampler's epoch of the current pass
        self._skip_epoch: int | None = None  # ... and of the pass a checkpoint stopped in

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._resumed()

    def _resumed(self) -> Iterator[Any]:
        # a generator: nothing runs until the first batch is asked for, i.e. after
        # Lightning's set_epoch for this epoch
        skip, self._skip = self._skip, 0
        epoch = getattr(self.sampler, "epoch", None)  # pinned by set_epoch before this pass
        self._epoch = epoch if isinstance(epoch, int) else None
        saved, self._skip_epoch = self._skip_epoch, None
        if skip >= len(self) or (saved is not None and saved != self._epoch):
            skip = 0  # the checkpoint's pass was a finished epoch: this one is new
        self._batches = 0
        iterator = super().__iter__()
        for _ in range(skip):
            next(iterator)
            self._batches += 1
        for batch in iterator:
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Batches of the current epoch handed out so far (and the sampler's epoch)."""
        state = {"batches": self._batches}
        if self._epoch is not None:
            state["epoch"] = self._epoch
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skip ``state["batches"]`` batches at the start of the next pass."""
        self._skip = int(state.get("batches", 0))
        self._batches = self._skip
        epoch = state.get("epoch")
        self._skip_epoch = None if epoch is None else int(epoch)


class StepSeed(Callback):
    """Reseed torch before every training batch from ``(seed, epoch, batch, rank)``.

    Without it, the random numbers of a step (dropout masks, sampled negatives)
    depend on everything that drew from the generator before: a resumed run,
    which skips the first steps and builds its data loaders at another moment,
    would draw different ones. With it, step ``(epoch, batch)`` on rank ``r``
    always draws the same numbers, in any run. ``seed=None`` uses the seed of
    ``seed_everything`` (``PL_GLOBAL_SEED``) or 0.

    ``--trainer.callbacks+=bft_lightning.utils.StepSeed`` on the command line.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        base = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        key = [base & 0xFFFFFFFF, trainer.current_epoch, batch_idx, trainer.global_rank]
        state = np.random.SeedSequence(key).generate_state(2, dtype=np.uint32)
        torch.manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)  # CPU and every CUDA device


class LastCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``every_n_train_steps`` steps and at every epoch's end.

    The best-checkpoint callback of a config (``monitor: val/ndcg@10``) writes
    only when validation runs; this one is what ``--ckpt_path last`` resumes
    from: a run killed between validations loses at most ``every_n_train_steps``
    steps (exactly resumed mid-epoch, see :class:`ResumableDataLoader`). It
    keeps one file (``save_top_k=0``, ``save_last=True``), overwritten in place.

    Before the first save of a run it sweeps the folder of temporary files that
    a killed writer left (``.tmp-*`` of :func:`atomic_torch_save`, ``.*.ckpt.*``
    partial files): nothing reads them, and a run killed in a loop would pile
    them up.
    """

    def __init__(self, every_n_train_steps: int = 50, dirpath: str | None = None) -> None:
        if every_n_train_steps < 1:
            raise ValueError(
                f"LastCheckpoint: every_n_train_steps must be >= 1, got {every_n_train_steps}"
            )
        super().__init__(
            dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps
        )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and trainer.is_global_zero and self.dirpath:
            sweep_temporary_files(self.dirpath)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # after the epoch's validation (it runs before this hook), so the saved
        # early-stopping and best-model state is the epoch's final one
        if trainer.fast_dev_run or trainer.sanity_checking:
            return
        if trainer.state.fn != "fit":
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def sweep_temporary_files(folder: str | os.PathLike) -> list[str]:
    """Remove the temporary files of interrupted checkpoint writes in ``folder``.

    Only names :func:`~bft_lightning.utils.checkpoint_io.atomic_torch_save`
    gives its temporary files (``.tmp-<name>.ckpt-<random>``); call it when no
    other process writes into ``folder`` (a run's own checkpoint folder, rank 0).
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(os.fspath(folder)))
    except OSError:
        return removed
    for entry in entries:
        name = str(entry.name)
        if entry.is_file() and (name.startswith(".tmp-") and ".ckpt-" in name):
            try:
                os.unlink(entry.path)
                removed.append(str(entry.path))
            except OSError:
                pass
    return removed
