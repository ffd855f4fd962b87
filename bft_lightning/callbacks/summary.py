"""``RunSummary``: the lines a person reads while a run goes and when it ends.

``python -m bft_lightning`` adds it to every trainer (rank 0 prints):

- after each validation epoch, one line: the epoch, the headline validation
  metrics (``val/ndcg@10``, ``val/hr@10``, ``val/mrr``, mean gain when BFT is
  on) and the best value of the monitored metric so far;
- at the end of ``fit``: why training stopped (early stopping converged, or
  the epoch/step cap cut it short while the metric was still improving), and
  where the best and the last checkpoints are;
- at the end of ``test``/``validate``: the metrics table (overall and per
  stratum, with ``n``, four significant digits) and the folder it was written
  to (``metrics.md``, ``metrics.json``, ``strata.png``).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer

__all__ = ["RunSummary", "stop_reason"]

_HEADLINE = (("ndcg@10", "NDCG@10"), ("hr@10", "HR@10"), ("mrr", "MRR"), ("gain", "mean K"))


def _say(trainer: Trainer, text: str) -> None:
    bar = trainer.progress_bar_callback
    if bar is not None and getattr(bar, "is_enabled", False) and hasattr(bar, "print"):
        bar.print(text)  # above the bar, not through it
    else:
        print(text, flush=True)


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
        for line in lines:
            _say(trainer, line)

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
