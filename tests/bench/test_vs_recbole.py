"""bench/vs_recbole.py: the RecBole settings and the report, without RecBole itself."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "vs_recbole.py"


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location("vs_recbole", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_recbole"] = module
    spec.loader.exec_module(module)
    return module


SETTINGS = {
    "d_model": 64, "nhead": 2, "num_layers": 2, "dim_feedforward": 256, "dropout": 0.2,
    "loss": "ce", "lr": 0.001, "weight_decay": 0.0, "max_len": 50, "batch_size": 256,
    "eval_batch_size": 512,
}  # fmt: skip


def run(seconds: list[float], valid: list[float], hr: float, ndcg: float, rows: int) -> dict:
    return {
        "epoch_seconds": seconds, "valid_ndcg10": valid, "train_rows": rows, "test_users": 100,
        "params": 10, "metrics": {"hit@10": hr, "ndcg@10": ndcg},
    }  # fmt: skip


def test_recbole_validates_and_stops_as_ours_only_with_converge(vs, tmp_path):
    """RecBole stops when its count of epochs without a better score exceeds
    stopping_step: P epochs without one is stopping_step P - 1, Lightning's patience P."""
    fixed = vs.recbole_config(SETTINGS, vs.parse_args(["--epochs", "3"]), tmp_path)
    assert fixed["eval_step"] == 0 and fixed["epochs"] == 3
    conv = vs.recbole_config(
        SETTINGS, vs.parse_args(["--epochs", "50", "--converge", "3"]), tmp_path
    )
    assert (conv["eval_step"], conv["stopping_step"], conv["epochs"]) == (1, 2, 50)
    assert conv["valid_metric"] == "NDCG@10" and conv["train_batch_size"] == 256
    with pytest.raises(SystemExit):
        vs.parse_args(["--converge", "-1"])


def test_converged_report_reads_the_runs(vs, tmp_path):
    """Best epochs, the accuracy differences and the time to the best epoch come from
    the runs; --report-from rewrites the same file from a finished run's summary."""
    ours = vs.row(
        "bft_lightning", run([10.0] * 6, [0.1, 0.3, 0.2, 0.3, 0.25, 0.2], 0.07, 0.035, 50), 300
    )
    rb = vs.row("RecBole", run([100.0] * 4, [0.2, 0.4, 0.39, 0.38], 0.08, 0.04, 300), 300)
    assert (ours["best_epoch"], rb["best_epoch"]) == (2, 2)  # the first of equal scores
    assert vs.row("x", run([1.0], [], 0.1, 0.1, 1), 1)["best_epoch"] is None
    results = tmp_path / "out.md"
    argv = ["--epochs", "200", "--converge", "3", "--results", str(results)]
    info = {
        "settings": SETTINGS, "data": {"users": 50, "items": 20, "short_users": 0},
        "machine": "test machine", "our_targets": 300, "versions": "v", "elapsed_s": 600.0,
        "argv": argv,
    }  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()
    (work / "summary.json").write_text(json.dumps({"rows": [ours, rb], "info": info}))
    vs.main(["--results", str(results), "--report-from", str(work)])  # the run's own options
    text = results.read_text()
    assert "| bft_lightning | 10.0 |" in text and "| 6 (2) |" in text and "| 4 (2) |" in text
    assert "0.0700 / 0.0800 (-12.5%)" in text and "0.0350 / 0.0400 (-12.5%)" in text
    assert "ours 0.3 min, RecBole 3.3 min" in text  # 2 x 10 s and 2 x 100 s
    assert "early stopping after 3 epochs" in text and "--report-from" not in text
    assert "ours on one row per user" in text
    info["argv"] = [*argv, "--train-rows", "prefix"]
    (work / "summary.json").write_text(json.dumps({"rows": [ours, rb], "info": info}))
    vs.main(["--results", str(results), "--report-from", str(work)])
    text = results.read_text()
    assert "ours on the same prefix rows (`train_rows: prefix`" in text
    assert "--train-rows prefix" in text  # the command that made the table
    with pytest.raises(SystemExit, match="no finished run"):
        vs.main([*argv, "--report-from", str(tmp_path / "missing")])
