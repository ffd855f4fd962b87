"""``RunSummary``: the lines a person reads while a run goes and when it ends.

``python -m bft_lightning`` adds it to every trainer (rank 0 prints):

- after each validation epoch, one line: the epoch, the headline validation
  metrics (``val/ndcg@10``, ``val/hr@10``, ``val/mrr``, mean gain when BFT is
  on) and the best value of the monitored metric so far;
- at the end of ``fit``: why training stopped (early stopping converged, or
  the epoch/step cap cut it short while the metric was still improving), and
  where the best and the last checkpoints are;
- at the end of ``test``: the metrics table (overall and per stratum, with
  ``n``, four significant digits) and the folder it was written to
  (``metrics.md``, ``metrics.json``, ``strata.png``); at the end of
  ``validate``: its one line of metrics.

What ends a run is printed last: the progress bar draws its final frame first
(:func:`finish_progress_bar`), so nothing of it follows the summary.
"""

from __future__ import annotations

import math
import sys
from datetime import timedelta
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    EarlyStopping,
    ModelCheckpoint,
    ModelSummary,
    RichModelSummary,
    RichProgressBar,
    Timer,
    TQDMProgressBar,
)
from lightning.pytorch.utilities.model_summary import (
    get_formatted_model_size,
    get_human_readable_count,
)

__all__ = ["RunSummary", "finish_progress_bar", "stop_reason", "without_unmeasured_flops"]

_HEADLINE = (("ndcg@10", "NDCG@10"), ("hr@10", "HR@10"), ("mrr", "MRR"), ("gain", "mean K"))


def _say(trainer: Trainer, text: str) -> None:
    bar = trainer.progress_bar_callback
    if bar is not None and getattr(bar, "is_enabled", False) and hasattr(bar, "print"):
        bar.print(text)  # above the bar, not through it
    else:
        print(text, flush=True)


def finish_progress_bar(trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
    """Stop the progress bar now, so that what is printed next comes after its last frame.

    Rich's bar is a live display that redraws itself below anything printed while it runs
    and draws its final frame when it stops, at teardown, which comes after ``on_fit_end``
    and ``on_test_end``; stopped here, its own teardown has nothing left to do. tqdm closes
    the stage's bar in its ``on_*_end``, which a callback listed before it precedes: closed
    here (closing twice does nothing)."""
    bar = trainer.progress_bar_callback
    if isinstance(bar, RichProgressBar):
        bar.teardown(trainer, pl_module, stage)
    elif isinstance(bar, TQDMProgressBar):
        name = {"fit": "train", "validate": "val"}.get(stage, stage)
        try:
            getattr(bar, f"{name}_progress_bar").close()
        except (AttributeError, TypeError):  # no bar of that stage was made
            pass
    for stream in (sys.stderr, sys.stdout):  # Lightning's log lines before ours
        stream.flush()


def _monitored(trainer: Trainer) -> tuple[ModelCheckpoint | None, EarlyStopping | None]:
    best = next(
        (c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.monitor),
        None,
    )
    return best, trainer.early_stopping_callback


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def stop_reason(trainer: Trainer) -> tuple[bool, str]:
    """(converged, sentence): whether early stopping ended ``fit``, said plainly."""
    stopper = trainer.early_stopping_callback
    if stopper is not None and stopper.stopped_epoch > 0:
        delta = abs(float(stopper.min_delta))
        by = f" by more than {delta:g}" if delta else ""
        return True, (
            f"early stopping converged: {stopper.monitor} did not improve{by} for "
            f"{stopper.patience} validations; stopped after epoch {stopper.stopped_epoch + 1}"
        )
    if trainer.interrupted:
        return False, "training was interrupted before it converged"
    timer = next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, Timer)), None)
    remaining = None if timer is None else timer.time_remaining("train")
    if remaining is not None and remaining <= 0:
        elapsed = timedelta(seconds=int(timer.time_elapsed("train")))  # type: ignore[union-attr]
        cap, flag = f"max_time (after {elapsed} of training)", "--trainer.max_time"
    elif trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        cap, flag = f"max_steps={trainer.max_steps}", "--trainer.max_steps"
    else:
        cap, flag = f"max_epochs={trainer.max_epochs}", "--trainer.max_epochs"
    if trainer.num_training_batches == 0 or trainer.global_step == 0:
        limit = getattr(trainer, "limit_train_batches", None)
        why = (
            f"before the cap {cap}; raise {flag}" if flag == "--trainer.max_time"
            else f"max_steps={trainer.max_steps}" if trainer.max_steps == 0
            else f"limit_train_batches={limit}" if limit in (0, 0.0)
            else "the training data gave no batch"
        )  # fmt: skip
        return False, (
            f"trained nothing: no training step ran ({why}); the weights are the initial ones"
        )
    if stopper is None:
        return False, f"stopped at the cap {cap} (no early stopping configured)"
    wait = stopper.wait_count
    when = "at the last validation" if wait == 0 else f"{wait} validation(s) before the end"
    if not math.isfinite(_float(stopper.best_score)):
        return False, (
            f"cut short: stopped at the cap {cap} before any validation gave {stopper.monitor} "
            f"(early stopping had nothing to compare); raise {flag} or validate more often"
        )
    return False, (
        f"cut short: stopped at the cap {cap} before early stopping converged ({stopper.monitor} "
        f"last improved {when}, patience {stopper.patience}); raise {flag} "
        "for a converged result"
    )


class RunSummary(Callback):
    """One line per validation epoch; the stop reason and checkpoint paths after ``fit``."""

    def __init__(self, test_table: bool = True) -> None:
        self.best: float | None = None
        self.test_table = test_table  # print the metrics table after test/validate

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        parts = [
            f"{label} {_float(metrics[f'val/{key}']):.4g}"
            for key, label in _HEADLINE
            if f"val/{key}" in metrics
        ]
        if not parts:
            return
        if trainer.state.fn == "validate":  # a checkpoint's weights: no epoch, nothing to beat
            finish_progress_bar(trainer, pl_module, "validate")
            print("validate: val " + ", ".join(parts), flush=True)
            return
        line = f"epoch {trainer.current_epoch + 1}"
        if trainer.max_epochs and trainer.max_epochs > 0:
            line += f"/{trainer.max_epochs}"
        line += f" step {trainer.global_step}: val " + ", ".join(parts)
        checkpoint, _ = _monitored(trainer)
        if checkpoint is not None and checkpoint.monitor in metrics:
            current = _float(metrics[checkpoint.monitor])
            stored = _float(checkpoint.best_model_score)
            better = max if checkpoint.mode == "max" else min
            candidates = [v for v in (current, stored, self.best) if v is not None]
            candidates = [v for v in candidates if not math.isnan(v)]
            if candidates:
                self.best = better(candidates)
                mark = " (new best)" if self.best == current else ""
                line += f" | best {checkpoint.monitor} {self.best:.4g}{mark}"
        _say(trainer, line)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or getattr(trainer, "fast_dev_run", False):
            return
        _, text = stop_reason(trainer)
        lines = [text]
        checkpoint, _ = _monitored(trainer)
        if checkpoint is not None and checkpoint.best_model_path:
            score = _float(checkpoint.best_model_score)
            lines.append(
                f"best checkpoint ({checkpoint.monitor} {score:.4g}): {checkpoint.best_model_path}"
            )
        last = next(
            (
                c.last_model_path
                for c in trainer.checkpoint_callbacks
                if isinstance(c, ModelCheckpoint) and c.last_model_path
            ),
            "",
        )
        if last:
            lines.append(f"last checkpoint (resume: --ckpt_path last): {last}")
        finish_progress_bar(trainer, pl_module, "fit")
        print("\n".join(lines), flush=True)

    def _eval_end(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        results = getattr(pl_module, f"{stage}_results", None)
        if (
            not self.test_table
            or not trainer.is_global_zero
            or not isinstance(results, dict)
            or not results
        ):
            return
        from bft_lightning.metrics.report import strata_table

        finish_progress_bar(trainer, pl_module, stage)
        print(f"\n{stage} metrics (full ranking):\n{strata_table(results)}", flush=True)
        where = getattr(pl_module, "_report_dir", lambda: None)()
        partial = stage == "test" and getattr(pl_module, "_partial_test", lambda: None)()
        if partial and where is not None and (where / "metrics_partial.md").is_file():
            print(f"partial evaluation ({partial}): written to {where}: metrics_partial.md, "
                  "metrics_partial.json, strata_partial.png", flush=True)  # fmt: skip
        elif where is not None and (where / "metrics.md").is_file():
            print(f"written to {where}: metrics.md, metrics.json, strata.png", flush=True)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_end(trainer, pl_module, "test")


def _measured(columns: list[tuple[str, list[str]]], flops: int) -> list[tuple[str, list[str]]]:
    """The model summary's columns, less ``FLOPs`` when none were counted: Lightning counts
    them only on a forward pass of ``example_input_array``, which these modules do not set."""
    return columns if flops else [c for c in columns if c[0] != "FLOPs"]


class _ModelTable(ModelSummary):
    """Lightning's model summary without a column of zero FLOPs (its "0 Total Flops" line is
    taken out at the command line's entry, ``utils/noise.py``)."""

    @staticmethod
    def summarize(  # type: ignore[override]
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        ModelSummary.summarize(
            _measured(summary_data, total_flops), total_parameters, trainable_parameters,
            model_size, total_training_modes, total_flops=total_flops, **summarize_kwargs,
        )  # fmt: skip


class _RichModelTable(RichModelSummary):
    """Lightning's rich model summary without the FLOPs column and total when none were
    counted (rich draws both whatever the columns, so the table is drawn here)."""

    @staticmethod
    def summarize(  # type: ignore[override]
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size,
                total_training_modes, total_flops=total_flops, **summarize_kwargs,
            )  # fmt: skip
            return
        from rich import get_console
        from rich.table import Table

        columns = _measured(summary_data, total_flops)
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            right = name in ("Params", "Params per Device", "In sizes", "Out sizes")
            style = "dim" if name == " " else "white" if name.endswith(" sizes") else None
            table.add_column(name, justify="right" if right else "left", style=style,
                             no_wrap=name == "Name")  # fmt: skip
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params",
             get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):  # fmt: skip
            grid.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(grid)


def without_unmeasured_flops(trainer: Trainer) -> None:
    """Replace Lightning's model summary (plain or rich, the default or one a config names)
    by the same that leaves out FLOPs when none were counted; a subclass of it is kept."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    for i, callback in enumerate(callbacks):
        kind = {RichModelSummary: _RichModelTable, ModelSummary: _ModelTable}.get(type(callback))
        if kind is not None:
            depth = getattr(callback, "_max_depth", 1)
            callbacks[i] = kind(depth, **getattr(callback, "_summarize_kwargs", {}))
