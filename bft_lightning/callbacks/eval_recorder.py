"""``EvalRecorder``: the shared loop of callbacks that measure BFT layers on eval batches.

On each validation / test epoch it switches recording on for the chosen layers
(batch by batch, optionally only the first ``max_batches``), lets the subclass
add the batch's statistics into fixed-size float64 sums, and at the epoch end
sums them across ranks (every rank, same condition) and hands the totals to
the subclass to log. Sums keep DDP results exact: a 2-process run reports
what one process would over the same samples. The samples that Lightning's
``DistributedSampler`` repeats to even out the ranks are left out
(:class:`~bft_lightning.callbacks.recording.PaddingRows`), so that holds with
its sampler too.

A subclass sets ``default_prefix`` (and ``record_attention`` when it needs the
attention weights) and implements ``init_sums``, ``accumulate`` and ``emit``.
The last dimension of a sum may start at 0 and grow (``widen``), e.g. to the
number of heads: before summing, ranks agree on each width by a max-reduce,
so a rank that saw no batch still takes part with zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from bft_lightning.callbacks import output
from bft_lightning.callbacks.recording import (
    Layers,
    PaddingRows,
    acquire,
    read_stats,
    release,
    select_layers,
)
from bft_lightning.nn.stats import FilterStats

STAGES = ("validate", "test")
_STAGE_SUFFIX = {"validate": "val", "test": "test"}


class EvalRecorder(Callback):
    """Base class: record BFT layers on validation / test batches, sum, reduce, emit.

    Args:
        layers: globs on module names or indices into the found layers; None = all.
        stages: where to measure: ``"validate"`` (validation, in fit too) and / or ``"test"``.
        max_batches: record at most this many batches per epoch (per rank and
            dataloader); None means all.
        prefix: tag prefix; the stage is appended (``{prefix}_val``, ``{prefix}_test``).
    """

    record_attention: ClassVar[bool | str] = False  # True, False or "off" (see ``acquire``)
    default_prefix: ClassVar[str] = "bft_eval"
    needs_logger: ClassVar[bool] = True  # warn when there is none (False: writes files)

    def __init__(
        self,
        layers: list[str | int] | None = None,
        stages: list[str] | None = None,
        max_batches: int | None = None,
        prefix: str | None = None,
    ) -> None:
        self.layer_patterns = layers
        self.stages = list(STAGES) if stages is None else list(stages)
        bad = [s for s in self.stages if s not in STAGES]
        if bad:
            raise ValueError(f"stages must be among {STAGES}, got {bad}")
        self.max_batches = max_batches
        self.prefix = self.default_prefix if prefix is None else prefix
        self.last_summary: dict[str, float] = {}
        self._layers: Layers = []
        self._sums: dict[str, Tensor] | None = None
        self._recording = False
        self._warned_no_logger = False
        self._warned_no_layers = False
        self._stage = "validate"  # the stage being measured and emitted
        self._padding = PaddingRows()

    # subclass interface
    def prepare(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        """At each measured epoch start; False skips the epoch (must agree on all ranks)."""
        return True

    def init_sums(self, n_layers: int, device: torch.device) -> dict[str, Tensor]:
        raise NotImplementedError

    def accumulate(self, batch: Any, stats: Sequence[FilterStats | None]) -> None:
        raise NotImplementedError

    def emit(self, trainer: Trainer, totals: dict[str, Tensor], prefix: str, step: int) -> None:
        raise NotImplementedError

    # helpers for subclasses
    @property
    def sums(self) -> dict[str, Tensor]:
        assert self._sums is not None, "sums are only available inside a measured epoch"
        return self._sums

    def widen(self, key: str, width: int) -> Tensor:
        """Grow the last dimension of ``sums[key]`` to at least ``width`` (zeros); return it."""
        t = self.sums[key]
        if t.shape[-1] < width:
            t = self.sums[key] = F.pad(t, (0, width - t.shape[-1]))
        return t

    def report_stem(self, trainer: Trainer, filename: str) -> str | None:
        """``log_dir/{filename}_{val|test}`` on global rank 0, None elsewhere.

        The stage is in the name so that ``test`` after ``fit`` in the same
        ``log_dir`` does not overwrite the validation report. A broadcast:
        call on every rank, from ``emit``.
        """
        return output.report_path(trainer, f"{filename}_{_STAGE_SUFFIX[self._stage]}")

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self._layers]

    # the loop
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._select(pl_module, warn=False)
        if self.needs_logger:
            self._warned_no_logger = output.warn_if_no_logger(
                trainer, type(self).__name__, self._warned_no_logger
            )

    def _select(self, pl_module: LightningModule, warn: bool = True) -> None:
        """Find the layers; again at each run start, since ``configure_model`` runs after
        ``setup``. No collective: every rank finds the same layers in the same model."""
        warn = warn and not self._warned_no_layers
        self._layers = select_layers(pl_module, self.layer_patterns, type(self).__name__, warn)
        self._warned_no_layers |= warn and not self._layers

    def _start(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._sums = None
        self._stage = stage
        self._padding.reset()
        if stage in self.stages and not trainer.sanity_checking and self._layers:
            if self.prepare(trainer, pl_module):
                self._sums = self.init_sums(len(self._layers), pl_module.device)

    def _batch_start(self, batch_idx: int) -> None:
        limit = self.max_batches
        if self._sums is not None and (limit is None or batch_idx < limit):
            acquire(self._layers, self, attention=self.record_attention)
            self._recording = True

    def _batch_end(self, trainer: Trainer, batch: Any, dataloader_idx: int) -> None:
        if self._recording:
            self._recording = False
            stats = read_stats(self._layers)
            self.accumulate(batch, self._padding.mask(trainer, self._stage, dataloader_idx, stats))
            release(self._layers, self)

    def _finish(self, trainer: Trainer, stage: str) -> None:
        if self._sums is None:
            return
        sums, self._sums = self._sums, None
        keys = sorted(sums)
        widths = torch.tensor([sums[k].shape[-1] for k in keys], device=sums[keys[0]].device)
        widths = output.reduce_max(trainer, widths)
        totals = {}
        for k, w in zip(keys, widths.tolist()):
            t = F.pad(sums[k], (0, int(w) - sums[k].shape[-1]))
            totals[k] = output.reduce_sum(trainer, t)
        self._stage = stage
        self.emit(trainer, totals, f"{self.prefix}_{_STAGE_SUFFIX[stage]}", trainer.global_step)

    # Lightning hooks
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "validate" in self.stages:
            self._select(pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "test" in self.stages:
            self._select(pl_module)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer, pl_module, "validate")

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer, pl_module, "test")

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._batch_start(batch_idx)

    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._batch_start(batch_idx)

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._batch_end(trainer, batch, dataloader_idx)

    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._batch_end(trainer, batch, dataloader_idx)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, "validate")

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, "test")

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        release(self._layers, self)
        self._sums, self._recording = None, False
