"""The language model's pre-training loop, shared by ``lm_synthetic.py`` and
``reproduce_lm.py``, with the trainer and the loss trace their fine-tuning runs use too.

``pretrain`` runs once per record file: a later call returns the record. Each script
builds its own data and model (``build``) and says what its record holds (``record``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L


class LossTrace(L.Callback):
    """Mean training loss over each window of ``every`` steps."""

    def __init__(self, every: int) -> None:
        self.every, self.window, self.trace = every, [], []  # type: ignore[var-annotated]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.window.append(float(outputs["loss"]))
        if len(self.window) == self.every:
            self.trace.append(round(sum(self.window) / self.every, 4))
            self.window = []
            print(f"  step {trainer.global_step}: loss {self.trace[-1]}", flush=True)


def lm_trainer(work: Path, accelerator: str = "cpu", **kw: Any) -> L.Trainer:
    """One device, no logger, checkpoints, progress bar or model summary."""
    return L.Trainer(
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
        **kw,
    )


@dataclass
class Fit:
    """What ``record`` reads: the fitted task and data, the trainer, the loss trace and
    the seconds the fit took."""

    task: Any
    dm: Any
    trainer: L.Trainer
    trace: list[float]
    seconds: int


def pretrain(
    done: Path,
    work: Path,
    steps: int,
    build: Callable[[], tuple[Any, Any]],
    record: Callable[[Fit], dict[str, Any]],
    *,
    accelerator: str = "cpu",
    every: int = 50,
    **trainer_kw: Any,
) -> dict[str, Any]:
    """The record in ``done`` when it exists; else seed 0, ``build()`` the task and its
    data, fit ``steps`` steps (the loss traced every ``every``), and write
    ``record(fit)`` to ``done`` (``record`` may save what else the base needs)."""
    if done.is_file():
        return json.loads(done.read_text())  # type: ignore[no-any-return]
    L.seed_everything(0)
    task, dm = build()
    trace = LossTrace(every)
    t0 = time.time()
    trainer = lm_trainer(
        work, accelerator, max_steps=steps, callbacks=[trace], check_val_every_n_epoch=None,
        **trainer_kw,
    )  # fmt: skip
    trainer.fit(task, dm)
    out = record(Fit(task, dm, trainer, trace.trace, round(time.time() - t0)))
    done.write_text(json.dumps(out, indent=1))
    return out
