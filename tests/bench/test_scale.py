"""bench/scale.py: growth exponents, and one tiny case through its steps to the table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "scale.py"


def load_scale():
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = module
    spec.loader.exec_module(module)
    return module


def test_growth_is_the_least_squares_log_log_slope() -> None:
    scale = load_scale()
    xs = [1e5, 1e6, 1e7]
    assert scale.growth(xs, [3 * x for x in xs]) == "1.00"
    assert scale.growth(xs, [x**2 for x in xs]) == "2.00"
    noisy = [2.0, 30.0, 200.0]
    want = np.polyfit(np.log(xs), np.log(noisy), 1)[0]
    assert scale.growth(xs, noisy) == f"{want:.2f}"
    assert scale.growth(xs, [None, 5.0, 50.0]) == "1.00"  # a missing point is left out
    assert scale.growth(xs, [None, None, 1.0]) == "-"


def test_make_log_is_a_power_law_log_in_time_order() -> None:
    scale = load_scale()
    user, item, times = scale.make_log(20_000, 1_000, seed=0)
    assert len(user) == len(item) == len(times) == 20_000
    assert np.all(np.diff(times) >= 0)  # the file is in global time order
    counts = np.bincount(item, minlength=1_000)
    assert counts[:10].sum() > counts[-500:].sum()  # Zipf: the head outweighs the tail


@pytest.mark.slow
def test_a_tiny_case_runs_its_steps_and_reports(tmp_path: Path) -> None:
    scale = load_scale()
    scale.CASES = {"tiny": (5_000, 500, 2, 100)}
    scale.LARGE = {}
    out, js = tmp_path / "table.md", tmp_path / "scale.json"
    common = ["--workdir", str(tmp_path), "--json", str(js), "--out", str(out)]
    scale.main(["--cases", "tiny", "--steps", "read,train:bce,train:ce_chunked,eval"] + common)
    results = json.loads(js.read_text())
    steps = results["tiny"]["steps"]
    assert steps["read"]["rows"] == 5_000
    assert steps["train:bce"]["batches"] == 2 and steps["train:ce_chunked"]["targets"] > 0
    assert steps["eval"]["eval_users"] <= steps["eval"]["eval_users_total"]
    scale.main(["report"] + common)
    table = out.read_text()
    assert "| 5e+03 | 5e+02 |" in table and "growth exponent" in table
    assert "train:bce" in table  # the per-step table with load and peak RSS
