"""``GainByContextLength``: does the Kalman gain track the effective sample size?

The paper's claim: BFT's gain ``K`` follows the effective sample size
``n_eff`` of the attention, while a learned sigmoid gate (gated attention,
Qiu et al. 2025) does not. On eval batches this callback buckets every valid
position by its context length and reports, per layer and bucket, the mean
``K`` (over groups), ``n_eff`` (over heads) and, when the layer has one, the
gate (over channels); plus the Pearson correlations ``corr(K, log n_eff)``
and ``corr(gate, log n_eff)`` over positions.

Context length of a position: with ``by="position"`` its 1-based index
among the valid positions of its sequence (the number of keys a causal
query sees, whichever side the padding is on); with ``by="length"`` the
sequence's number of valid positions (for bidirectional models). Buckets are
``[edges[k], edges[k+1])`` and ``[edges[-1], inf)``.

Layers with ``precision="off"`` (the gated baseline) record their attention
weights on measured batches: they compute ``n_eff`` only from them.
A position where K, n_eff or the gate is NaN or infinite is left out of every
mean and correlation and counted instead: otherwise one such value would make
its whole bucket and the layer's correlations NaN, which loggers drop and the
report would show like an empty bucket.
All sums are fixed-size and summed across ranks (DDP-exact).

Logged (``{p}`` = ``gain_ctx_val`` / ``gain_ctx_test``): ``{p}/L/K/ctx{lo}``,
``{p}/L/n_eff/ctx{lo}``, ``{p}/L/gate/ctx{lo}``, ``{p}/L/corr_K_log_neff``,
``{p}/L/corr_gate_log_neff``, ``{p}/L/nonfinite`` (positions left out); files
``{filename}_val.md`` / ``{filename}_test.md`` and the same ``.png`` in
``trainer.log_dir`` (in the report, ``-`` marks a cell with no position,
``nan`` a value undefined for another reason, e.g. a constant gate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from lightning.pytorch import Trainer
from torch import Tensor

from bft_lightning.callbacks import output, report
from bft_lightning.callbacks.eval_recorder import EvalRecorder
from bft_lightning.nn.stats import FilterStats

DEFAULT_EDGES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# columns of the per-bucket sums
_COUNT, _K, _NEFF, _GATE_COUNT, _GATE = range(5)
# moments for the correlations: x = log n_eff
_MOMENTS = ("n", "k", "x", "kk", "xx", "kx", "ng", "g", "gg", "gx")


def context_length(valid: Tensor, by: str) -> Tensor:
    """(B, T) context length of each position (see the module docstring)."""
    if by == "position":
        return valid.long().cumsum(dim=1)
    return valid.long().sum(dim=1, keepdim=True).expand_as(valid)


def pearson(n: Tensor, sx: Tensor, sy: Tensor, sxx: Tensor, syy: Tensor, sxy: Tensor) -> Tensor:
    """Pearson correlation from summed moments (NaN when a variance is 0)."""
    cov = n * sxy - sx * sy
    var = (n * sxx - sx.square()) * (n * syy - sy.square())
    out = cov / var.clamp_min(0).sqrt()
    return torch.where(var > 1e-12 * n.square().clamp_min(1) ** 2, out, torch.nan)


def bucket_labels(edges: Sequence[int]) -> list[str]:
    labels = [f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])]
    return labels + [f"{edges[-1]}+"]


class GainByContextLength(EvalRecorder):
    """Mean K, n_eff and gate by context-length bucket, and their correlations.

    Args:
        bucket_edges: increasing lower bucket edges (context lengths); None
            means ``[1, 2, 4, ..., 256]``.
        by: ``"position"`` (index among valid positions; causal models) or
            ``"length"`` (valid length of the sequence; bidirectional models).
        layers: globs on module names or indices into the found layers; None = all.
        stages: ``"validate"`` and / or ``"test"``.
        max_batches: record at most this many batches per epoch; None means all.
        prefix: tag prefix; the stage is appended.
        filename: report file stem in ``trainer.log_dir``; the stage is appended
            (``{filename}_val.md``, ``{filename}_test.png``); None writes no files.
    """

    record_attention: ClassVar[bool | str] = "off"
    default_prefix: ClassVar[str] = "gain_ctx"
    needs_logger: ClassVar[bool] = False

    def __init__(
        self,
        bucket_edges: list[int] | None = None,
        by: str = "position",
        layers: list[str | int] | None = None,
        stages: list[str] | None = None,
        max_batches: int | None = None,
        prefix: str | None = None,
        filename: str | None = "gain_by_context",
    ) -> None:
        super().__init__(layers=layers, stages=stages, max_batches=max_batches, prefix=prefix)
        self.edges = list(DEFAULT_EDGES if bucket_edges is None else bucket_edges)
        if not self.edges or any(b <= a for a, b in zip(self.edges, self.edges[1:])):
            raise ValueError(f"bucket_edges must be non-empty and increasing, got {self.edges}")
        if by not in ("position", "length"):
            raise ValueError(f"by must be 'position' or 'length', got {by!r}")
        self.by, self.filename = by, filename
        self.last_means: dict[str, Tensor] = {}
        self.last_corr: dict[str, Tensor] = {}
        self.last_nonfinite = torch.zeros(0)

    def init_sums(self, n_layers: int, device: torch.device) -> dict[str, Tensor]:
        z = torch.zeros
        return {
            "buckets": z(n_layers, len(self.edges), 5, dtype=torch.float64, device=device),
            "moments": z(n_layers, len(_MOMENTS), dtype=torch.float64, device=device),
            "nonfinite": z(n_layers, dtype=torch.float64, device=device),
        }

    def accumulate(self, batch: Any, stats: Sequence[FilterStats | None]) -> None:
        edges = None
        for i, s in enumerate(stats):
            if s is None:
                continue
            if edges is None:
                edges = torch.tensor(self.edges, device=s.valid.device)
            ctx = context_length(s.valid, self.by).contiguous()
            bucket = torch.searchsorted(edges, ctx, right=True) - 1
            keep = s.valid & (bucket >= 0)
            k = s.gain.mean(-1)[keep].double()
            x = s.n_eff.mean(-1)[keep].double()
            g = s.gate.mean(-1)[keep].double() if s.gate is not None else torch.zeros_like(k)
            finite = k.isfinite() & x.isfinite() & g.isfinite()
            sums = self.sums["buckets"]
            self.sums["nonfinite"][i] += (~finite).sum().to(sums.device, torch.float64)
            k, x, g = k[finite], x[finite], g[finite]
            has_gate = torch.full_like(k, float(s.gate is not None))
            cols = torch.stack([torch.ones_like(k), k, x, has_gate, g], dim=-1)  # (N, 5)
            sums[i].index_add_(0, bucket[keep][finite].to(sums.device), cols.to(sums.device))
            moments = _moments(k, x.clamp_min(1).log(), g, has_gate)
            self.sums["moments"][i] += moments.to(sums.device)

    def emit(self, trainer: Trainer, totals: dict[str, Tensor], prefix: str, step: int) -> None:
        b, m = totals["buckets"].cpu(), totals["moments"].cpu()
        self.last_nonfinite = totals["nonfinite"].cpu()
        count, gate_count = b[..., _COUNT], b[..., _GATE_COUNT]
        self.last_means = {
            "K": _safe_div(b[..., _K], count),
            "n_eff": _safe_div(b[..., _NEFF], count),
            "gate": _safe_div(b[..., _GATE], gate_count),
            "count": count,
            "gate_count": gate_count,
        }
        mm = dict(zip(_MOMENTS, m.unbind(-1)))
        self.last_corr = {
            "K": pearson(mm["n"], mm["k"], mm["x"], mm["kk"], mm["xx"], mm["kx"]),
            "gate": pearson(mm["ng"], mm["g"], mm["x"], mm["gg"], mm["xx"], mm["gx"]),
        }
        self.last_summary = self._scalars(prefix)
        output.log_scalars(trainer, self.last_summary, step)
        if self.filename is not None:
            self._write(self.report_stem(trainer, self.filename), prefix, step)

    def _scalars(self, prefix: str) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for i, name in enumerate(self.layer_names):
            for key in ("K", "n_eff", "gate"):
                for lo, v in zip(self.edges, self.last_means[key][i].tolist()):
                    scalars[f"{prefix}/{name}/{key}/ctx{lo}"] = v
            scalars[f"{prefix}/{name}/corr_K_log_neff"] = float(self.last_corr["K"][i])
            scalars[f"{prefix}/{name}/corr_gate_log_neff"] = float(self.last_corr["gate"][i])
            nonfinite = float(self.last_nonfinite[i])
            if nonfinite > 0 or self.last_means["count"][i].sum() > 0:
                scalars[f"{prefix}/{name}/nonfinite"] = nonfinite
        return scalars

    def _write(self, stem: str | None, prefix: str, step: int) -> None:
        if stem is None:
            return
        names, cols = self.layer_names, bucket_labels(self.edges)
        seen = torch.nonzero(self.last_means["count"].sum(0) > 0).flatten()
        n = int(seen.max()) + 1 if seen.numel() else len(cols)  # drop trailing empty buckets
        cols = cols[:n]
        means = {k: v[:, :n] for k, v in self.last_means.items()}
        empty, no_gate = means["count"] == 0, means["gate_count"] == 0
        corr = torch.stack([self.last_corr["K"], self.last_corr["gate"]], dim=-1)
        corr_empty = (self.last_means["count"].sum(1) == 0).unsqueeze(1).expand_as(corr).clone()
        corr_empty[:, 1] |= self.last_means["gate_count"].sum(1) == 0
        left_out = self.last_nonfinite.view(-1, 1)
        text = [
            f"# Gain by context length ({prefix}, step {step})\n",
            f"Context length by `{self.by}`; means over valid positions (K over groups, "
            "n_eff over heads, gate over channels).\n",
            report.markdown_table("Mean Kalman gain K", names, cols, means["K"], empty=empty),
            report.markdown_table("Mean n_eff", names, cols, means["n_eff"], "{:.2f}", empty=empty),
            report.markdown_table("Mean gate", names, cols, means["gate"], empty=no_gate),
            report.markdown_table("Positions", names, cols, means["count"], "{:.0f}"),
            report.markdown_table(
                "Correlation with log n_eff", names, ["K", "gate"], corr, "{:.3f}", corr_empty
            ),
            report.markdown_table(
                "Positions left out (NaN or infinite K, n_eff or gate)",
                names,
                ["positions"],
                left_out,
                "{:.0f}",
            ),
        ]
        report.write_text(f"{stem}.md", "\n".join(text))
        panels = [("mean K", names, means["K"]), ("mean n_eff", names, means["n_eff"])]
        if not torch.isnan(means["gate"]).all():
            panels.append(("mean gate", names, means["gate"]))
        title = f"Gain by context length ({prefix}, step {step})"
        report.save_line_plot(f"{stem}.png", cols, panels, title, "context length")


def _moments(k: Tensor, x: Tensor, g: Tensor, has_gate: Tensor) -> Tensor:
    n = float(k.numel())
    ng = has_gate.sum()
    parts = [k.new_tensor(n), k.sum(), x.sum(), (k * k).sum(), (x * x).sum(), (k * x).sum()]
    gx = (g * x * has_gate).sum()
    parts += [ng, (g * has_gate).sum(), (g * g * has_gate).sum(), gx]
    return torch.stack(parts)


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    return torch.where(den > 0, num / den.clamp_min(1e-300), math.nan)
