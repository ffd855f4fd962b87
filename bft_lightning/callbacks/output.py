"""Reductions across ranks and writing to whatever loggers the trainer has.

Every function that talks to other processes (``reduce_sum``, ``reduce_max``,
``log_dir``) must be called by every rank under the same condition; the
writers are safe everywhere (loggers write on rank 0 only).
"""

from __future__ import annotations

import math
import os
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from bft_lightning.callbacks.histogram import Histogram


def reduce_sum(trainer: Trainer, tensor: Tensor) -> Tensor:
    """Elementwise sum over ranks (a clone: the input is left alone). Call on every rank."""
    return trainer.strategy.reduce(tensor.clone(), reduce_op="sum")


def reduce_max(trainer: Trainer, tensor: Tensor) -> Tensor:
    """Elementwise max over ranks (a clone). Call on every rank."""
    return trainer.strategy.reduce(tensor.clone(), reduce_op="max")


def log_dir(trainer: Trainer) -> str:
    """``trainer.log_dir`` (a broadcast: call on every rank)."""
    path = trainer.log_dir
    return path if path is not None else trainer.default_root_dir


def warn_if_no_logger(trainer: Trainer, who: str, warned: bool) -> bool:
    """Warn once that nothing will be logged; returns the new ``warned`` flag."""
    if trainer.loggers or warned:
        return warned
    rank_zero_warn(
        f"{who}: the trainer has no logger, so nothing will be logged; the last "
        "statistics stay available on the callback (`last_summary`). Pass a logger "
        "(e.g. `Trainer(logger=TensorBoardLogger(...))`) to record them."
    )
    return True


def log_scalars(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    """Send finite scalars to every logger (rank 0 writes; any Lightning logger)."""
    finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
    if not finite:
        return
    for logger in trainer.loggers:
        logger.log_metrics(finite, step=step)


def histogram_writers(trainer: Trainer) -> list[Any]:
    """Experiments of the loggers that accept raw histograms (TensorBoard's SummaryWriter)."""
    writers = []
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if callable(getattr(experiment, "add_histogram_raw", None)):
            writers.append(experiment)
    return writers


def log_histograms(writers: list[Any], histograms: dict[str, Histogram], step: int) -> None:
    """Write non-empty histograms with ``add_histogram_raw``."""
    for tag, h in histograms.items():
        if h.num <= 0:
            continue
        for w in writers:
            w.add_histogram_raw(
                tag=tag,
                min=h.min,
                max=h.max,
                num=int(h.num),
                sum=h.sum,
                sum_squares=h.sum_squares,
                bucket_limits=h.limits.tolist(),
                bucket_counts=h.counts.tolist(),
                global_step=step,
            )


def report_path(trainer: Trainer, filename: str) -> str | None:
    """``log_dir/filename`` on global rank 0, None elsewhere (a broadcast: call on every rank)."""
    directory = log_dir(trainer)
    return os.path.join(directory, filename) if trainer.is_global_zero else None
