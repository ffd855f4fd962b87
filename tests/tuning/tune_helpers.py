"""Shared set-up of the tune tests: a tiny synthetic fit and a way to run ``tune``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from bft_lightning.cli import entry

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "experiments" / "sasrec_off_synthetic.yaml")


def tiny(tmp: Path) -> list[str]:
    """Fit overrides for a trial of a few seconds: small data, 2 epochs of 4 batches."""
    return [
        "--max-epochs", "2", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=1",
        "--trainer.check_val_every_n_epoch=1", "--data.init_args.synthetic_users=600",
        "--data.init_args.synthetic_items=200", "--data.init_args.eval_batch_size=1024",
        f"--trainer.logger.init_args.save_dir={tmp / 'logs'}",
    ]  # fmt: skip


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def tune(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """``python -m bft_lightning tune ARGS`` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as stop:
        entry(["tune", *args])
    out, err = capsys.readouterr()
    return int(stop.value.code or 0), out, err


def tune_process(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """``tune`` as a real process (killed, or beside another worker); output into ``log``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "bft_lightning", "tune", *args]
    with open(log, "w") as stream:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stream, stderr=subprocess.STDOUT)


class StopOnce(Callback):
    """Ctrl+C at the start of epoch ``at`` (from 0) of the first run that reaches it (a
    marker file remembers that it happened); ``marker``.epochs lists every epoch trained,
    in order, so a test can tell a resumed run from one started over."""

    def __init__(self, marker: str, at: int = 2) -> None:
        self.marker, self.at = Path(marker), at

    def on_train_epoch_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        if trainer.current_epoch == self.at and not self.marker.exists():
            self.marker.write_text("stopped")
            raise KeyboardInterrupt
        with open(f"{self.marker}.epochs", "a") as journal:
            journal.write(f"{trainer.current_epoch}\n")
