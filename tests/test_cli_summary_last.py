"""The run's own summary is the last thing ``python -m bft_lightning`` prints (fit, test,
predict): the progress bar's final frame comes before it, in a terminal and in a captured
stream alike."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "experiments" / "sasrec_on_synthetic.yaml"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _args(save_dir: Path) -> list[str]:
    return [
        "--config", str(CONFIG), f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.max_epochs=1", "--trainer.check_val_every_n_epoch=1",
        "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2",
        "--trainer.limit_test_batches=2", "--trainer.limit_predict_batches=2",
        "--data.init_args.synthetic_users=300",
        "--data.init_args.max_len=12", "--model.init_args.backbone.init_args.d_model=16",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
    for name in ("NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR"):
        env.pop(name, None)
    return env


def _run(args: list[str], cwd: Path, tty: bool) -> str:
    """stdout and stderr as one stream, as a person sees it (a pseudo-terminal when ``tty``),
    ANSI escapes taken out."""
    cmd = [sys.executable, "-m", "bft_lightning", *args]
    if not tty:
        done = subprocess.run(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stdout.decode(errors="replace")[-3000:]
        return ANSI.sub("", done.stdout.decode(errors="replace"))
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return ANSI.sub("", text)


def _check_last(stream: str, first: str, last: str) -> None:
    """Nothing of a progress bar (its rate, ``it/s``) after the summary's first line, and the
    summary's last line is the last text of the stream."""
    start = stream.rfind(first)
    assert start >= 0, stream[-3000:]
    assert "it/s" not in stream[start:], stream[start - 500 :]
    lines = [line.strip() for line in re.split(r"[\r\n]+", stream) if line.strip()]
    assert last in lines[-1], lines[-6:]
    assert "Total FLOPs: 0" not in stream and "0 Total Flops" not in stream  # nothing measured


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "captured"])
def test_the_summary_comes_after_the_progress_bar(tmp_path, tty: bool) -> None:
    fit = _run(["fit", *_args(tmp_path)], tmp_path, tty)
    _check_last(fit, "cut short: stopped at the cap max_epochs=1", "last.ckpt")
    if tty:  # test's table and predict's file the same way (fit is enough for a pipe)
        out = _run(["test", *_args(tmp_path), "--ckpt_path", "best"], tmp_path, tty)
        _check_last(out, "test metrics (full ranking)", "written to ")
        out = _run(["predict", *_args(tmp_path), "--ckpt_path", "best"], tmp_path, tty)
        _check_last(out, "RecommendationWriter: wrote", "predictions.csv")
