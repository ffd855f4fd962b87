"""``EpochTimer``: seconds per training epoch with the epoch's validation left out."""

from __future__ import annotations

import time

from lightning.pytorch import Callback, LightningModule, Trainer


class EpochTimer(Callback):
    """Wall-clock seconds of each training epoch, validation excluded.

    Lightning runs an epoch's validation before the epoch's end hook, so the
    time from epoch start to end holds it on every validated epoch; the
    validation windows are measured and subtracted. A run resumed from a
    checkpoint written at an epoch's end enters the end hook without that
    epoch's start: nothing is timed then. ``times`` holds one value per epoch.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start: float | None = None
        self._val_start = 0.0
        self._val = 0.0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start, self._val = time.perf_counter(), 0.0

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._start is not None:  # not the sanity check before training
            self._val += time.perf_counter() - self._val_start

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._start is not None:
            self.times.append(time.perf_counter() - self._start - self._val)
        self._start = None
