"""What a study shows a person: a line per trial, the best trial, a table and two plots.

Files written into ``--out``: ``best.yaml`` (a complete ``fit`` config, written
by the caller), ``trials.md`` and ``trials.csv`` (every counted trial: number,
state, value, best epoch, seconds, parameters, reason, run folder),
``history.png`` (optimisation history) and ``importances.png`` (parameter
importances; they need two completed trials whose values differ, else a
one-line note says why there is none), both with Optuna's matplotlib
visualisation.
"""

from __future__ import annotations

import csv
import io
import math
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from bft_lightning.tuning.study import counts

__all__ = ["best_lines", "progress_line", "short_names", "write_plots", "write_tables"]


def short_names(keys: list[str]) -> dict[str, str]:
    """Each option's last path component, or more of it where two would collide."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            short = ".".join(p for p in parts[-n:] if p != "init_args") or key
            others = [k for k in keys if k != key]
            if not any(
                ".".join(p for p in k.split(".")[-n:] if p != "init_args") == short for k in others
            ):
                break
        out[key] = short
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _value(t: FrozenTrial) -> float | None:
    if t.value is not None:
        return float(t.value)
    if t.intermediate_values:  # pruned: the last value it reported
        return float(t.intermediate_values[max(t.intermediate_values)])
    return None


def progress_line(t: FrozenTrial, monitor: str) -> str:
    """``trial 3 COMPLETE val/ndcg@10=0.1234 (epoch 5) lr=0.003 dropout=0.21  41.2 s``."""
    names = short_names(list(t.params))
    params = " ".join(f"{names[k]}={_fmt(v)}" for k, v in t.params.items())
    value = _value(t)
    metric = (
        f"{monitor}={value:.4f}" if value is not None and math.isfinite(value) else f"{monitor}=-"
    )
    if t.state == TrialState.COMPLETE and t.user_attrs.get("best_epoch") is not None:
        metric += f" (epoch {t.user_attrs['best_epoch']})"
    seconds = t.user_attrs.get("seconds")
    line = f"trial {t.number:>3} {t.state.name:<8} {metric}  {params}"
    if seconds is not None:
        line += f"  {seconds:.1f} s"
    if t.user_attrs.get("retry_of") is not None:
        line += f"  (retry of trial {t.user_attrs['retry_of']})"
        if t.user_attrs.get("resumed_from"):
            line += "  resumed from its last checkpoint"
    if t.state == TrialState.FAIL and t.user_attrs.get("fail_reason"):
        line += f"  -- {t.user_attrs['fail_reason']}"
    return line


def best_lines(study: optuna.Study, monitor: str, space_keys: list[str]) -> list[str]:
    """The best trial's metric and parameters (every searched one, fixed ones too)."""
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if not done:
        return ["no trial completed: there is no best trial"]
    best = study.best_trial
    lines = [
        f"best: trial {best.number}, {monitor} = {best.value:.4f}"
        + (f" at epoch {best.user_attrs['best_epoch']}" if "best_epoch" in best.user_attrs else "")
    ]
    for key, value in best.user_attrs.get("values", best.params).items():
        lines.append(f"  {key}: {_fmt(value)}")
    if best.user_attrs.get("best_ckpt"):
        lines.append(f"  checkpoint: {best.user_attrs['best_ckpt']}")
    return lines


def _rows(study: optuna.Study) -> tuple[list[str], list[list[Any]]]:
    trials = [t for t in study.get_trials(deepcopy=False) if counts(t)]
    keys: list[str] = []
    for t in trials:
        keys += [k for k in t.params if k not in keys]
    header = ["trial", "state", "value", "best_epoch", "seconds", *keys, "reason", "run_dir"]
    rows = []
    for t in trials:
        rows.append([
            t.number, t.state.name, _value(t), t.user_attrs.get("best_epoch"),
            t.user_attrs.get("seconds"), *(t.params.get(k) for k in keys),
            t.user_attrs.get("fail_reason") or t.user_attrs.get("pruned") or "",
            t.user_attrs.get("run_dir") or "",
        ])  # fmt: skip
    return header, rows


def write_tables(study: optuna.Study, out: Path, monitor: str) -> None:
    header, rows = _rows(study)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    (out / "trials.csv").write_text(buffer.getvalue())
    names = short_names([h for h in header[5:-2]])
    shown = [*header[:5], *(names[h] for h in header[5:-2]), *header[-2:]]
    shown[2] = monitor
    lines = [
        f"# Study {study.study_name}: {len(rows)} trials "
        f"({study.direction.name.lower()} {monitor})",
        "",
        "| " + " | ".join(shown) + " |",
        "|" + "---|" * len(shown),
    ]
    for row in rows:
        cells = ["" if v is None else _fmt(v) for v in row]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    (out / "trials.md").write_text("\n".join(lines) + "\n")


def write_plots(study: optuna.Study, out: Path) -> list[str]:
    """``history.png`` and ``importances.png``; returns a note per plot not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    from optuna.visualization import matplotlib as vis

    notes = []
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib backend experimental
        _save(vis.plot_optimization_history(study), out / "history.png")
        values = {t.value for t in complete}
        if len(complete) < 2 or len(values) < 2:
            notes.append(
                "importances.png not drawn: parameter importances need at least 2 completed "
                f"trials with different values ({len(complete)} completed)"
            )
            (out / "importances.png").unlink(missing_ok=True)
        else:
            try:
                _save(vis.plot_param_importances(study), out / "importances.png")
            except (ValueError, RuntimeError, ZeroDivisionError) as err:
                notes.append(f"importances.png not drawn: {err}")
    return notes


def _save(axes: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
