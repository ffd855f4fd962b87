"""bench/lm_synthetic.py --stage report: rows, paired differences, the two noise studies."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "lm_synthetic.py"
QUESTIONS = [f"q{i}" for i in range(40)]


@pytest.fixture(scope="module")
def lm_synthetic():
    spec = importlib.util.spec_from_file_location("lm_synthetic", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_run(out: Path, mod, method: str, noise: float, seed: int, correct, in_inputs=False):
    """A finished run as ``run_sft`` writes it (only the fields the report reads)."""
    name = mod.run_name(method, noise, 0, seed, in_inputs)
    per_q = {q: [float(c), float(c)] for q, c in zip(QUESTIONS, correct)}
    run = {
        "name": name,
        "method": method,
        "noise_rate": noise,
        "distractors": 0,
        "seed": seed,
        "noise_in_inputs": in_inputs,
        "test_em": float(np.mean(correct)),
        "test_f1": float(np.mean(correct)),
        "fit_seconds": 10.0,
        "per_question": per_q,
    }
    (out / "synthetic_runs").mkdir(parents=True, exist_ok=True)
    (out / "synthetic_runs" / f"{name}.json").write_text(json.dumps(run))
    return run


def test_report_pairs_by_question_and_seed_and_keeps_the_noise_studies_apart(
    tmp_path, lm_synthetic
):
    rng = np.random.default_rng(0)
    runs = {}
    for seed in (0, 1):
        for method, p in (("off", 0.8), ("bft", 0.7)):
            runs[method, 0.0, seed] = write_run(
                tmp_path, lm_synthetic, method, 0.0, seed, rng.random(40) < p
            )
            runs[method, 0.3, seed] = write_run(
                tmp_path, lm_synthetic, method, 0.3, seed, rng.random(40) < p - 0.2
            )
            # noise in the answer text: its own runs, the same clean references
            runs[method, "text", seed] = write_run(
                tmp_path, lm_synthetic, method, 0.3, seed, rng.random(40) < p - 0.3, True
            )
    assert lm_synthetic.run_name("bft", 0.3, 0, 1, True) != lm_synthetic.run_name("bft", 0.3, 0, 1)
    rows = lm_synthetic.report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == json.loads(json.dumps(rows))
    by = {(r["task"], r["method"], r["noise"]): r for r in summary}
    assert {r["method"] for r in summary} <= {"off", "bft", "focal", "label_smoothing"}
    for r in summary:
        assert 0.0 <= r["em"] <= 1.0 and 0.0 <= r["f1"] <= 1.0
        assert r["seeds"] == [0, 1]

    def expected(key):
        d = []
        for seed in (0, 1):
            ref = runs["off", key, seed]["per_question"]  # off under the same noise
            new = runs["bft", key, seed]["per_question"]
            d += [new[q][0] - ref[q][0] for q in QUESTIONS]
        return np.mean(d), np.std(d, ddof=1) / math.sqrt(len(d))

    for task, noise, key in (
        ("synthetic_qa", 0.0, 0.0),
        ("synthetic_qa", 0.3, 0.3),
        ("synthetic_qa_noisy_inputs", 0.3, "text"),
    ):
        row = by[task, "bft", noise]
        mean, se = expected(key)
        assert row["paired_delta_em"] == pytest.approx(mean)
        assert row["paired_se_em"] == pytest.approx(se)
        assert row["paired_n"] == 80
        off = by[task, "off", noise]
        assert off["em"] == pytest.approx(np.mean([runs["off", key, s]["test_em"] for s in (0, 1)]))
    # the label-noise rows never read the text-noise runs (and vice versa)
    for method in ("off", "bft"):
        for task, key in (("synthetic_qa", 0.3), ("synthetic_qa_noisy_inputs", "text")):
            em = np.mean([runs[method, key, s]["test_em"] for s in (0, 1)])
            assert by[task, method, 0.3]["em"] == pytest.approx(em)
    # one row per method x noise x distractors: the clean references are not repeated
    keys = [(r["task"] != "synthetic_qa_noisy_inputs", r["method"], r["noise"]) for r in summary]
    assert len(keys) == len(set(keys))
    assert all(r["noise"] for r in summary if r["task"] == "synthetic_qa_noisy_inputs")
    table = (tmp_path / "synthetic_tables.md").read_text()
    assert "| text | 0.3 | 0 | bft |" in table and "| labels | 0.3 | 0 | bft |" in table
    assert (tmp_path / "synthetic_em_vs_noise.png").stat().st_size > 0


def test_stop_time_is_the_next_occurrence_across_midnight(lm_synthetic) -> None:
    """``--stop-at`` HH:MM is the next such time: a study started at 23:57 with a stop at
    00:03 runs until the next day's 00:03, not zero minutes; a full date is taken as it is."""
    import argparse
    import calendar
    import time

    def utc(text: str) -> float:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%d %H:%M:%S")))

    late = utc("2026-12-06 23:57:30")
    assert lm_synthetic.stop_time("00:03", now=late) == utc("2026-12-07 00:03:00")
    assert lm_synthetic.stop_time("23:59", now=late) == utc("2026-12-06 23:59:00")
    assert lm_synthetic.stop_time("23:57", now=late) == utc("2026-12-06 23:57:00")  # this minute
    assert lm_synthetic.stop_time("2026-12-07T00:03") == utc("2026-12-07 00:03:00")
    assert lm_synthetic.stop_time("2026-12-06T23:00", now=late) < late  # past: stop at once
    with pytest.raises(argparse.ArgumentTypeError, match="expected YYYY-MM-DDTHH:MM or HH:MM"):
        lm_synthetic.stop_time("25:99")
