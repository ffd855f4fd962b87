"""``GainByStratum``: the Kalman gain of rare against frequent items.

The paper's mechanism analysis: rare items should get a different gain (and
prior precision) than frequent ones. On eval batches this callback takes, at
every valid position, the popularity quartile of the item there (read from
the batch, ``batch[item_key]``) and aggregates per layer and quartile the mean
``K`` (over groups), ``log lambda`` (the prior entering the layer; for layer 0
the item's ``log tau``), ``log lambda_obs`` and ``n_eff``.

Quartiles follow ``bft_lightning.metrics.strata`` (the ranking metrics' rule):
items ``1..num_items`` sorted by training frequency, cut into four groups;
Q0 holds the rarest 25%. The frequency (``(num_items + 1,)``, index 0 =
padding) comes from ``trainer.datamodule.item_frequency`` when the datamodule
has it, else from the ``item_frequency`` argument; without either the
callback warns and measures nothing.

``batch[item_key]`` may be (B, T), aligned with the layer's positions (the
input item at each position, e.g. ``input_ids``), or (B,) (e.g. ``target``:
the stratum of the target item, for every valid position of the sequence).
Ids outside ``1..num_items`` (padding, a mask token) are skipped. A position
where K, log lambda, log lambda_obs or n_eff is NaN or infinite is left out of
every mean and counted instead, so one diverging value does not turn its
whole stratum into NaN (which loggers drop and the report would show like an
empty stratum). Sums are fixed-size and summed across ranks (DDP-exact).

Logged (``{p}`` = ``stratum_val`` / ``stratum_test``): ``{p}/L/K/Q{j}``,
``{p}/L/log_prec/Q{j}``, ``{p}/L/n_eff/Q{j}``, ``{p}/L/nonfinite`` (positions
left out); files, with the stage in the name (``{filename}_val`` on validation,
``{filename}_test`` on test), in ``trainer.log_dir``: ``.md`` (tables, ``-``
where a stratum had no position), ``.json`` (the same numbers for programs:
``{"layers": [...], "strata": ["Q0", ...], "K": [[per stratum] per layer], ...,
"nonfinite": [per layer]}``, null where a stratum had no position) and ``.png``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from bft_lightning.callbacks import output, report
from bft_lightning.callbacks.eval_recorder import EvalRecorder
from bft_lightning.metrics.strata import NUM_STRATA, assign_item_stratum, popularity_quartiles
from bft_lightning.nn.stats import FilterStats

# columns of the per-stratum sums
COLUMNS = ("count", "K", "log_prec", "log_prec_obs", "n_eff")


class GainByStratum(EvalRecorder):
    """Mean K, log lambda, log lambda_obs and n_eff per item-popularity quartile.

    Args:
        item_frequency: training count per item id (index 0 = padding); used
            when ``trainer.datamodule`` has no ``item_frequency``.
        item_key: the batch key with the item ids: (B, T) per position (the
            input items, default ``"input_ids"``) or (B,) per sequence (``"target"``).
        layers: globs on module names or indices into the found layers; None = all.
        stages: ``"validate"`` and / or ``"test"``.
        max_batches: record at most this many batches per epoch; None means all.
        prefix: tag prefix; the stage is appended (``stratum_val``, ``stratum_test``).
        filename: report file stem in ``trainer.log_dir``; the stage is appended
            (``{filename}_val.md``, ``{filename}_test.json``, ...); None writes no files.
    """

    record_attention: ClassVar[bool | str] = "off"  # n_eff of precision="off" layers
    default_prefix: ClassVar[str] = "stratum"
    needs_logger: ClassVar[bool] = False

    def __init__(
        self,
        item_frequency: list[float] | None = None,
        item_key: str = "input_ids",
        layers: list[str | int] | None = None,
        stages: list[str] | None = None,
        max_batches: int | None = None,
        prefix: str | None = None,
        filename: str | None = "gain_by_stratum",
    ) -> None:
        super().__init__(layers=layers, stages=stages, max_batches=max_batches, prefix=prefix)
        self.item_frequency = None if item_frequency is None else torch.as_tensor(item_frequency)
        self.item_key, self.filename = item_key, filename
        self.last_means: dict[str, Tensor] = {}
        self.last_nonfinite = torch.zeros(0)
        self._freq: Tensor | None = None
        self._bounds: Tensor | None = None
        self._warned: set[str] = set()

    def prepare(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        freq = getattr(getattr(trainer, "datamodule", None), "item_frequency", None)
        freq = self.item_frequency if freq is None else freq
        if freq is None:
            self._warn_once(
                "no_freq",
                "GainByStratum: no item frequency (neither `trainer.datamodule.item_frequency` "
                "nor the `item_frequency` argument); nothing is measured.",
            )
            return False
        self._freq = torch.as_tensor(freq).to(pl_module.device, torch.float64)
        self._bounds = popularity_quartiles(self._freq)
        return True

    def init_sums(self, n_layers: int, device: torch.device) -> dict[str, Tensor]:
        shape = (n_layers, NUM_STRATA, len(COLUMNS))
        return {
            "strata": torch.zeros(shape, dtype=torch.float64, device=device),
            "nonfinite": torch.zeros(n_layers, dtype=torch.float64, device=device),
        }

    def accumulate(self, batch: Any, stats: Sequence[FilterStats | None]) -> None:
        for i, s in enumerate(stats):
            ids = self._item_ids(batch, s)
            if s is None or ids is None:
                continue
            assert self._freq is not None and self._bounds is not None
            keep = s.valid & (ids > 0) & (ids < self._freq.numel())
            ids = ids.clamp(0, self._freq.numel() - 1)
            stratum = assign_item_stratum(ids, self._freq, self._bounds)[keep]
            k = s.gain.mean(-1)[keep]
            cols = [torch.ones_like(k), k, s.log_prec.mean(-1)[keep]]
            cols += [s.log_prec_obs.mean(-1)[keep], s.n_eff.mean(-1)[keep]]
            sums = self.sums["strata"]
            values = torch.stack(cols, dim=-1).double().to(sums.device)
            finite = values.isfinite().all(-1)
            self.sums["nonfinite"][i] += (~finite).sum().to(sums.device, torch.float64)
            sums[i].index_add_(0, stratum.to(sums.device)[finite], values[finite])

    def _item_ids(self, batch: Any, s: FilterStats | None) -> Tensor | None:
        """``batch[item_key]`` as (B, T) aligned with the layer's positions, or None."""
        if s is None:
            return None
        if not isinstance(batch, Mapping) or self.item_key not in batch:
            self._warn_once("key", f"GainByStratum: batches have no key {self.item_key!r}.")
            return None
        ids = torch.as_tensor(batch[self.item_key]).to(s.valid.device).long()
        if ids.shape == s.valid.shape:
            return ids
        if ids.ndim == 1 and ids.shape[0] == s.valid.shape[0]:
            return ids.unsqueeze(1).expand_as(s.valid)
        b, t = s.valid.shape
        if ids.ndim == 2 and ids.shape[0] == b and ids.shape[1] > t and not ids[:, :-t].any():
            return ids[:, -t:]  # the model trimmed columns of left padding
        self._warn_once(
            "shape",
            f"GainByStratum: batch[{self.item_key!r}] has shape {tuple(ids.shape)}, but the "
            f"layer has {tuple(s.valid.shape)} positions; expected (B, T) or (B,). Skipped.",
        )
        return None

    def emit(self, trainer: Trainer, totals: dict[str, Tensor], prefix: str, step: int) -> None:
        t = totals["strata"].cpu()
        count = t[..., 0]
        self.last_means = {c: _mean(t[..., j], count) for j, c in enumerate(COLUMNS) if j}
        self.last_means["count"] = count
        self.last_nonfinite = nonfinite = totals["nonfinite"].cpu()
        self.last_summary = {}
        for i, name in enumerate(self.layer_names):
            for c in ("K", "log_prec", "n_eff"):
                for j in range(NUM_STRATA):
                    self.last_summary[f"{prefix}/{name}/{c}/Q{j}"] = float(self.last_means[c][i, j])
            if nonfinite[i] > 0 or count[i].sum() > 0:
                self.last_summary[f"{prefix}/{name}/nonfinite"] = float(nonfinite[i])
        output.log_scalars(trainer, self.last_summary, step)
        if self.filename is not None:
            self._write(self.report_stem(trainer, self.filename), prefix, step)

    def _write(self, stem: str | None, prefix: str, step: int) -> None:
        if stem is None:
            return
        names, cols = self.layer_names, [f"Q{j}" for j in range(NUM_STRATA)]
        m = self.last_means
        empty = m["count"] == 0
        text = [
            f"# Gain by item stratum ({prefix}, step {step})\n",
            f"Popularity quartile (training frequency; Q0 = rarest 25% of items) of "
            f"`batch[{self.item_key!r}]` at each valid position. Means over positions "
            "(and over precision groups / heads).\n",
            report.markdown_table("Mean Kalman gain K", names, cols, m["K"], empty=empty),
            report.markdown_table(
                "Mean log lambda (prior)", names, cols, m["log_prec"], empty=empty
            ),
            report.markdown_table(
                "Mean log lambda_obs", names, cols, m["log_prec_obs"], empty=empty
            ),
            report.markdown_table("Mean n_eff", names, cols, m["n_eff"], "{:.2f}", empty),
            report.markdown_table("Positions", names, cols, m["count"], "{:.0f}"),
            report.markdown_table(
                "Positions left out (NaN or infinite K, log lambda, log lambda_obs or n_eff)",
                names,
                ["positions"],
                self.last_nonfinite.view(-1, 1),
                "{:.0f}",
            ),
        ]
        report.write_text(f"{stem}.md", "\n".join(text))
        table = {"prefix": prefix, "step": step, "item_key": self.item_key}
        table |= {"layers": list(names), "strata": cols}
        for c in ("K", "log_prec", "log_prec_obs", "n_eff", "count"):
            table[c] = [[None if math.isnan(x) else x for x in row] for row in m[c].tolist()]
        table["nonfinite"] = self.last_nonfinite.tolist()
        report.write_text(f"{stem}.json", json.dumps(table, indent=1))
        measured = m["K"][~empty]
        if measured.numel() and bool((measured == 1).all()):
            return  # precision="off": K is 1 everywhere, a plot of it would mean nothing
        panels = [("mean K", names, m["K"]), ("mean log lambda (prior)", names, m["log_prec"])]
        title = f"Gain by item stratum ({prefix}, step {step})"
        report.save_line_plot(f"{stem}.png", cols, panels, title, "item popularity quartile")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)


def _mean(total: Tensor, count: Tensor) -> Tensor:
    return torch.where(count > 0, total / count.clamp_min(1), math.nan)
