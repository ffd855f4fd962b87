"""``PrecisionMonitor``: histograms and summaries of every BFT layer's filter state.

Works on any LightningModule: the BFT layers are found by the recording
protocol (``bft_lightning.nn.FilterRecorder``), and recording is switched on
only for the batches that are logged, so the other steps cost nothing.

Logged per layer ``L`` (the module name, e.g. ``encoder.layers.0``) and
quantity ``X`` (a ``FilterStats`` field), under ``prefix`` (``bft``; ``bft_val``
on validation):

- ``{prefix}/L/X``: a TensorBoard histogram of ``X`` at valid positions;
- ``{prefix}/L/X/mean``: its mean (any logger);
- ``{prefix}/L/X/p10`` ...: percentiles of the quantities in ``percentiles``;
- ``{prefix}/L/X/nonfinite``: how many values were NaN or infinite (left out
  of the histogram, so a diverging layer does not look healthy);
- ``{prefix}/L/q`` and ``{prefix}/L/q/g{i}``: process noise ``Q`` per group.

Quantities: ``log_prec`` (log lambda, the prior entering the layer),
``log_prec_obs`` (log lambda_obs), ``log_prec_post`` (log lambda', the
posterior after the update), ``log_prec_out`` (log lambda'' after the predict
step), ``gain`` (K), ``n_eff``, ``jbar`` (Jbar), ``gate`` (the sigmoid gate
of gated attention, when present) and ``q``. Layers with ``precision="off"``
report ``K = 1`` and zero log precisions. Their ``n_eff`` needs the attention
weights, so it is logged only with ``off_layer_n_eff=True``: asking for the
weights makes a fused kernel (``attention_impl="chunked"`` or ``"sdpa"``)
take the reference kernel on logged batches, which rounds differently (the
off twin would no longer train bit-identically with and without the
monitor), and holds a (B, H, T, T) tensor per layer.

Under DDP every rank computes fixed-bin counts and ``[n, sum, sumsq,
nonfinite]``, which are summed across ranks (and ``[max, -min]``
max-reduced) once per logged step: the logged histogram and non-finite count
equal those a single process would compute over the same samples (on
validation, the samples that Lightning's ``DistributedSampler`` repeats to
even out the ranks are left out: ``recording.PaddingRows``). Means
come from the summed moments; percentiles from the summed counts, so they are
bin-resolution estimates (within one bin width, ``(hi - lo) / bins``).
Whether a step is logged depends on ``trainer.global_step`` only, so every
rank reaches the collectives together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from bft_lightning.callbacks import output
from bft_lightning.callbacks.histogram import (
    MOMENTS,
    Bins,
    Histogram,
    extremes_row,
    histogram_row,
)
from bft_lightning.callbacks.histogram import percentile as bin_percentile
from bft_lightning.callbacks.recording import (
    Layers,
    PaddingRows,
    acquire,
    is_plain,
    read_stats,
    release,
    select_layers,
)
from bft_lightning.nn.stats import FilterStats

#: Per-position quantities of ``FilterStats`` and their default histogram ranges.
DEFAULT_RANGES: dict[str, tuple[float, float]] = {
    "log_prec": (-20.0, 20.0),
    "log_prec_obs": (-20.0, 20.0),
    "log_prec_post": (-20.0, 20.0),
    "log_prec_out": (-20.0, 20.0),
    "gain": (0.0, 1.0),
    "n_eff": (0.0, 256.0),
    "jbar": (-2.0, 2.0),
    "gate": (0.0, 1.0),
    "q": (0.0, 1.0),
}
QUANTITIES: tuple[str, ...] = tuple(DEFAULT_RANGES)
#: Quantities with per-position values, hence percentiles (``q`` has one value per group).
PERCENTILE_QUANTITIES: tuple[str, ...] = tuple(q for q in QUANTITIES if q != "q")


class PrecisionMonitor(Callback):
    """Log the filter state (precision, gain, n_eff, Jbar, Q) of every BFT layer.

    Args:
        every_n_steps: log one training batch every this many optimizer steps
            (when ``trainer.global_step % every_n_steps == 0``).
        layers: which layers: globs on module names (``"encoder.layers.*"``) or
            indices into the found layers (``0``, ``-1``); None means all.
        quantities: which ``FilterStats`` quantities to log (see the module
            docstring); None means all.
        log_on_validation: also log each validation epoch, accumulated over
            its batches (tags under ``{prefix}_val``).
        val_max_batches: record at most this many batches per validation
            epoch (per rank and dataloader); None means all.
        bins: histogram bins per quantity.
        ranges: ``{quantity: [lo, hi]}`` overriding the default ranges (values
            outside land in the edge bins; the true min / max are kept).
        percentiles: ``{quantity: [10, 50, 90]}``: percentile scalars (0..100)
            to log, for logged quantities other than ``q``; None means
            ``{"gain": [10, 50, 90]}`` when ``gain`` is logged.
        histograms: write TensorBoard histograms (scalars go to every logger).
        prefix: tag prefix. Two monitors in one trainer that log the same
            layer and quantity need different prefixes (their tags would mix).
        off_layer_n_eff: record the attention weights of ``precision="off"``
            layers on logged batches, to log their ``n_eff`` (see the module
            docstring for why this is off by default).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        layers: list[str | int] | None = None,
        quantities: list[str] | None = None,
        log_on_validation: bool = False,
        val_max_batches: int | None = None,
        bins: int = 100,
        ranges: dict[str, tuple[float, float]] | None = None,
        percentiles: dict[str, list[float]] | None = None,
        histograms: bool = True,
        prefix: str = "bft",
        off_layer_n_eff: bool = False,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps, self.layer_patterns = every_n_steps, layers
        self.quantities = _check_names(quantities, "quantities")
        self._quantities_arg = quantities
        self.log_on_validation, self.val_max_batches = log_on_validation, val_max_batches
        self.bins = {q: Bins(*DEFAULT_RANGES[q], bins) for q in QUANTITIES}
        for q, (lo, hi) in (ranges or {}).items():
            self.bins[_check_names([q], "ranges")[0]] = Bins(float(lo), float(hi), bins)
        if percentiles is None:
            percentiles = {"gain": [10.0, 50.0, 90.0]} if "gain" in self.quantities else {}
        self.percentiles = percentiles
        _check_percentiles(self.percentiles, self.quantities)
        self.histograms, self.prefix = histograms, prefix
        self.off_layer_n_eff = off_layer_n_eff
        self.last_step, self.num_logged = -1, 0
        self.last_histograms: dict[str, Histogram] = {}
        self.last_summary: dict[str, float] = {}
        self._layers: Layers = []
        self._recording = False
        self._val: _Accumulator | None = None
        self._padding = PaddingRows()  # DistributedSampler's repeats on validation
        self._warned_no_logger = False
        self._warned_no_layers = False

    @property
    def state_key(self) -> str:
        """Distinct for monitors that log different tags, so several can share a trainer.

        ``layers`` and ``quantities`` join the key only when given, so a default
        monitor keeps the key of older checkpoints and resumes from them.
        """
        given = {"layers": self.layer_patterns, "quantities": self._quantities_arg}
        extra = {k: v for k, v in given.items() if v is not None}
        return self._generate_state_key(
            prefix=self.prefix, every_n_steps=self.every_n_steps, **extra
        )

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "num_logged": self.num_logged}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = int(state_dict.get("last_step", -1))
        self.num_logged = int(state_dict.get("num_logged", 0))

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._select(pl_module, warn=False)
        self._warned_no_logger = output.warn_if_no_logger(
            trainer, type(self).__name__, self._warned_no_logger
        )

    def _select(self, pl_module: LightningModule, warn: bool = True) -> None:
        """Find the layers; again at each run start, since ``configure_model`` runs after
        ``setup``. No collective: every rank finds the same layers in the same model."""
        warn = warn and not self._warned_no_layers
        self._layers = select_layers(pl_module, self.layer_patterns, type(self).__name__, warn)
        self._warned_no_layers |= warn and not self._layers

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._select(pl_module)
        self._check_tags_unique(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._select(pl_module)

    def _check_tags_unique(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Two monitors writing the same tag would mix their series into one: refuse."""
        mine = {name for name, _ in self._layers}
        for other in trainer.callbacks:  # type: ignore[attr-defined]
            if other is self or not isinstance(other, PrecisionMonitor):
                continue
            if other.prefix != self.prefix:
                continue
            theirs = select_layers(pl_module, other.layer_patterns, type(other).__name__, False)
            layers = sorted(mine & {name for name, _ in theirs})
            quantities = [q for q in self.quantities if q in other.quantities]
            if layers and quantities:
                raise ValueError(
                    f"PrecisionMonitor: two monitors log layer {layers[0]!r}, quantity "
                    f"{quantities[0]!r} under the same prefix {self.prefix!r}; give one a "
                    "different `prefix` (or change the existing monitor instead of adding one)"
                )

    def _acquire(self) -> None:
        """Record the layers (and, with ``off_layer_n_eff``, the weights of off layers)."""
        off = "n_eff" in self.quantities and self.off_layer_n_eff
        acquire(self._layers, self, attention="off" if off else False)

    def should_log(self, trainer: Trainer) -> bool:
        """Whether this training batch is logged: depends on ``global_step`` only."""
        step = trainer.global_step
        return bool(self._layers) and step % self.every_n_steps == 0 and step != self.last_step

    # training: one batch per logged step
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._recording = self.should_log(trainer)
        if self._recording:
            self.last_step = trainer.global_step
            self._acquire()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._recording:
            return
        self._recording = False
        acc = _Accumulator(self, pl_module.device)
        acc.add(read_stats(self._layers))
        release(self._layers, self)
        self._emit(trainer, acc, self.prefix, self.last_step)

    # validation: accumulate over the epoch, reduce once at its end
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        active = self.log_on_validation and not trainer.sanity_checking and bool(self._layers)
        self._val = _Accumulator(self, pl_module.device) if active else None
        self._padding.reset()

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        limit = self.val_max_batches
        if self._val is not None and (limit is None or batch_idx < limit):
            self._acquire()
            self._recording = True

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._val is not None and self._recording:
            stats = read_stats(self._layers)
            self._val.add(self._padding.mask(trainer, "validate", dataloader_idx, stats))
            release(self._layers, self)
            self._recording = False

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._val is not None:
            self._emit(trainer, self._val, f"{self.prefix}_val", trainer.global_step)
            self._val = None

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        release(self._layers, self)

    def _emit(self, trainer: Trainer, acc: _Accumulator, prefix: str, step: int) -> None:
        """Reduce (every rank), then log (rank 0 writes)."""
        rows = output.reduce_sum(trainer, acc.rows)
        extremes = output.reduce_max(trainer, acc.extremes)
        self.last_histograms, self.last_summary = self._summarise(rows, extremes, acc, prefix)
        if self.histograms:
            output.log_histograms(output.histogram_writers(trainer), self.last_histograms, step)
        output.log_scalars(trainer, self.last_summary, step)
        self.num_logged += 1

    def _summarise(
        self, rows: Tensor, extremes: Tensor, acc: _Accumulator, prefix: str
    ) -> tuple[dict[str, Histogram], dict[str, float]]:
        hists: dict[str, Histogram] = {}
        scalars: dict[str, float] = {}
        for i, (name, _) in enumerate(self._layers):
            for j, q in enumerate(acc.names):
                h = Histogram.from_rows(rows[i, j], extremes[i, j], self.bins[q])
                if h.num <= 0 and h.nonfinite <= 0:
                    continue
                tag = f"{prefix}/{name}/{q}"
                scalars[f"{tag}/nonfinite"] = h.nonfinite
                if h.num <= 0:
                    continue
                hists[tag] = h
                scalars[f"{tag}/mean"] = h.mean
                for p in self.percentiles.get(q, []):
                    scalars[f"{tag}/p{p:g}"] = bin_percentile(h.counts, self.bins[q], p)
            q_values = acc.q[i]
            if "q" in self.quantities and q_values is not None:
                self._summarise_q(q_values, f"{prefix}/{name}/q", hists, scalars)
        return hists, scalars

    def _summarise_q(
        self, q: Tensor, tag: str, hists: dict[str, Histogram], scalars: dict[str, float]
    ) -> None:
        """Q is a parameter (equal on every rank): histogram over groups, no reduce."""
        bins = self.bins["q"]
        hists[tag] = h = Histogram.from_rows(histogram_row(q, bins), extremes_row(q), bins)
        scalars[f"{tag}/nonfinite"] = h.nonfinite
        scalars[f"{tag}/mean"] = float(q.mean())
        scalars.update({f"{tag}/g{g}": float(v) for g, v in enumerate(q.tolist())})


class _Accumulator:
    """Fixed-size sums over batches: (layers, quantities, bins + 3) counts and moments."""

    def __init__(self, monitor: PrecisionMonitor, device: torch.device) -> None:
        self.names = [q for q in monitor.quantities if q != "q"]
        self.bins = [monitor.bins[q] for q in self.names]
        n_layers, n_bins = len(monitor._layers), monitor.bins["gain"].n
        shape = (n_layers, len(self.names))
        self.rows = torch.zeros(*shape, n_bins + MOMENTS, dtype=torch.float64, device=device)
        self.extremes = torch.full((*shape, 2), float("-inf"), dtype=torch.float64, device=device)
        self.q: list[Tensor | None] = [None] * n_layers
        # off layers report zeros for n_eff unless their weights were recorded
        self.skip_n_eff = [
            is_plain(layer) and not monitor.off_layer_n_eff for _, layer in monitor._layers
        ]

    def add(self, stats: Sequence[FilterStats | None]) -> None:
        for i, s in enumerate(stats):
            if s is None:
                continue
            self.q[i] = s.q
            for j, (name, bins) in enumerate(zip(self.names, self.bins)):
                if getattr(s, name) is None or (name == "n_eff" and self.skip_n_eff[i]):
                    continue
                values = s.masked(name)
                self.rows[i, j] += histogram_row(values, bins).to(self.rows.device)
                self.extremes[i, j] = torch.maximum(
                    self.extremes[i, j], extremes_row(values).to(self.rows.device)
                )


def _check_percentiles(percentiles: Mapping[str, Sequence[float]], quantities: list[str]) -> None:
    """Fail at construction, not at the first logged step (which may be hours in)."""
    for key, values in percentiles.items():
        if key not in PERCENTILE_QUANTITIES or key not in quantities:
            choices = [q for q in quantities if q in PERCENTILE_QUANTITIES]
            raise ValueError(
                f"percentiles: key {key!r} is not a logged quantity with percentiles; "
                f"choose from {choices} (q has one value per group: see q/g{{i}})"
            )
        for p in values:
            ok = isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 100
            if not ok:
                raise ValueError(f"percentiles[{key!r}]: {p!r} is not a percentile in [0, 100]")


def _check_names(names: Sequence[str] | Mapping[str, Any] | None, option: str) -> list[str]:
    chosen = list(QUANTITIES if names is None else names)
    unknown = [n for n in chosen if n not in QUANTITIES]
    if unknown:
        raise ValueError(f"{option}: unknown quantities {unknown}; choose from {QUANTITIES}")
    return chosen
