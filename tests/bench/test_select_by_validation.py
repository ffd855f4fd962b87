"""bench/select_by_validation.py: each twin's setting chosen on validation, paired on test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from bft_lightning.metrics.strata import assign_item_stratum, popularity_quartiles

SCRIPT = Path(__file__).parents[2] / "bench" / "select_by_validation.py"
USERS, ITEMS = 400, 60


def fake_run(base: Path, table: str, variant: str, seed: int, ranks, val: list[float] | None):
    """A finished run as reproduce_rec.py leaves it (ranks, strata inputs, log)."""
    out = base / table / f"{variant}_s{seed}"
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)  # the same users and targets for every run
    np.save(out / "targets.npy", rng.integers(1, ITEMS + 1, USERS))
    np.save(out / "item_frequency.npy", np.arange(ITEMS + 1))
    np.save(out / "history_len.npy", rng.integers(2, 40, USERS))
    np.save(out / "ranks.npy", ranks)
    (out / "summary.json").write_text(json.dumps({"hardware": "cpu", "metrics": {}}))
    (out / "fit_done").write_text("{}")
    if val is not None:
        writer = SummaryWriter(str(out / "tb" / "version_0"))
        for step, v in enumerate(val):
            writer.add_scalar("val/ndcg@10", v, step)
        writer.close()


def run_script(base: Path, *args: str) -> tuple[str, dict]:
    out = base / "table.md"
    cmd = [sys.executable, str(SCRIPT), "--runs-dir", str(base), "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out.read_text(), json.loads(out.with_suffix(".json").read_text())


def test_chooses_each_twins_best_validation_setting_and_pairs_on_test(tmp_path):
    rng = np.random.default_rng(1)
    ranks = {
        name: [rng.integers(0, 30, USERS) for _ in range(2)]
        for name in ("a_off", "b_off", "a_on", "b_on")
    }
    vals = {"a_off": 0.040, "b_off": 0.045, "a_on": 0.050, "b_on": 0.030}
    for name, per_seed in ranks.items():
        table, variant = name.split("_")
        for seed, r in enumerate(per_seed):
            fake_run(tmp_path, table, variant, seed, r, [0.01, vals[name] + 0.001 * seed, 0.02])
    text, result = run_script(
        tmp_path, "--off", "a:off", "b:off", "--on", "a:on", "b:on", "--seeds", "0", "1"
    )
    c = result["comparison"]
    assert (c["off"], c["on"]) == ("b:off", "a:on")  # the best validation, not the first
    hr = {k: np.mean([(r < 10).astype(float) for r in v], axis=0) for k, v in ranks.items()}
    d = hr["a_on"] - hr["b_off"]
    assert c["delta_hr10"][0] == pytest.approx(d.mean())
    assert c["delta_hr10"][1] == pytest.approx(d.std(ddof=1) / np.sqrt(USERS))
    per_seed = [(ranks["a_on"][s] < 10).mean() - (ranks["b_off"][s] < 10).mean() for s in (0, 1)]
    assert c["per_seed_delta_hr10"] == pytest.approx(per_seed)
    row = next(r for r in result["settings"] if r["table"] == "b" and r["twin"] == "off")
    assert row["val_ndcg10"] == pytest.approx(0.0455, abs=1e-6)  # mean of each run's best
    assert "**b:off**" in text and "**a:on**" in text


def test_runs_without_a_validation_log_are_left_out_of_the_choice_only(tmp_path):
    rng = np.random.default_rng(2)
    for seed in range(3):
        logged = seed > 0  # seed 0 came back without its log
        fake_run(tmp_path, "t", "off", seed, rng.integers(0, 30, USERS), [0.04] if logged else None)
        fake_run(tmp_path, "t", "on", seed, rng.integers(0, 30, USERS), [0.05])
    _, result = run_script(tmp_path, "--off", "t:off", "--on", "t:on", "--seeds", "0", "1", "2")
    off = next(r for r in result["settings"] if r["twin"] == "off")
    on = next(r for r in result["settings"] if r["twin"] == "on")
    assert off["val_seeds"] == [1, 2] and off["seeds"] == [0, 1, 2]
    assert on["val_seeds"] == [0, 1, 2]  # the other twin's missing log does not matter
    cmd = [sys.executable, str(SCRIPT), "--runs-dir", str(tmp_path), "--off", "t:off",
           "--on", "t:on", "--seeds", "0", "1", "2", "--min-val-seeds", "3"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode != 0 and "t:off" in done.stderr and "[1, 2]" in done.stderr


def test_settings_are_compared_on_the_seeds_all_of_them_logged(tmp_path):
    """A setting missing its worst seed's log must not win on its remaining seeds."""
    rng = np.random.default_rng(3)
    vals = {"a": [None, 0.040, 0.040], "b": [0.020, 0.045, 0.045]}  # b better on 1, 2
    for table, per_seed in vals.items():
        for seed, v in enumerate(per_seed):
            fake_run(tmp_path, table, "off", seed, rng.integers(0, 30, USERS), v and [v])
    for seed in range(3):
        fake_run(tmp_path, "a", "on", seed, rng.integers(0, 30, USERS), [0.05])
    _, result = run_script(
        tmp_path, "--off", "a:off", "b:off", "--on", "a:on", "--seeds", "0", "1", "2"
    )
    assert result["comparison"]["off"] == "b:off"
    assert all(r["val_seeds"] == [1, 2] for r in result["settings"] if r["twin"] == "off")


def _reproduce_rec():  # type: ignore[no-untyped-def]
    """bench/reproduce_rec.py as a module (the bench folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "reproduce_rec", Path(__file__).parents[2] / "bench" / "reproduce_rec.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reproduce_summary_has_same_seed_differences_overall_and_on_the_rarest(tmp_path):
    """reproduce_rec.summarise: per-seed ΔHR@10 overall and on Q0 equal direct counts."""
    import argparse

    rr = _reproduce_rec()
    rng = np.random.default_rng(1)
    ranks = {}
    for variant in ("off", "on_frequency"):
        for seed in (0, 1):
            ranks[variant, seed] = rng.integers(0, 30, USERS)
            fake_run(tmp_path, "t", variant, seed, ranks[variant, seed], None)
    runs = rr.load_runs(tmp_path / "t", ["off", "on_frequency"])
    for run in runs.values():  # fields a finished run's summary has
        run["summary"].update(sec_per_epoch=1.0, epochs=3, best_epoch=2, tau=None)
    args = argparse.Namespace(dataset="d", backbone="b", tag="", loss_normalization="targets")
    (row,) = [r for r in rr.summarise(args, runs, [0, 1], tmp_path) if r["variant"] != "off"]
    assert row["tag"] == ""
    # runs with the loss per batch row never share a summary key with the older tables
    rows_args = argparse.Namespace(dataset="d", backbone="b", tag="x", loss_normalization="rows")
    assert {r["tag"] for r in rr.summarise(rows_args, runs, [0, 1], tmp_path)} == {"rows_x"}
    first = runs["off", 0]
    freq = torch.as_tensor(first["item_frequency"])
    q = assign_item_stratum(
        torch.as_tensor(first["targets"]), freq, popularity_quartiles(freq)
    ).numpy()
    for i, seed in enumerate((0, 1)):
        on, off = ranks["on_frequency", seed] < 10, ranks["off", seed] < 10
        assert row["per_seed_delta_hr10"][i] == pytest.approx(on.mean() - off.mean())
        rare = q == 0
        assert rare.any()
        assert row["per_seed_delta_hr10_q0"][i] == pytest.approx(on[rare].mean() - off[rare].mean())


def test_same_seed_columns_give_the_se_over_seeds(tmp_path):
    """Besides the SE over users, the table gives each seed's difference and their mean
    with the SE over seeds (SD / sqrt(seeds)), which sees training noise."""
    rng = np.random.default_rng(2)
    for name in ("a_off", "a_on"):
        table, variant = name.split("_")
        for seed in range(3):
            fake_run(tmp_path, table, variant, seed, rng.integers(0, 30, USERS), [0.04, 0.05])
    text, result = run_script(tmp_path, "--off", "a:off", "--on", "a:on", "--seeds", "0", "1", "2")
    for key in ("per_seed_delta_hr10", "per_seed_delta_ndcg10"):
        d = np.array(result["comparison"][key])
        se = d.std(ddof=1) / np.sqrt(len(d))
        assert f"mean {d.mean():+.4f} ({se:.4f})" in text


def test_reproduce_rec_states_the_strata_sizes():
    """The table says how many items and test users each popularity group holds, and
    the training-frequency range: tied counts make Q0 larger than a quarter."""
    sys.path.insert(0, str(SCRIPT.parent))
    import reproduce_rec as rr

    sizes = {"items": [40, 0, 10, 10], "max_freq": [2, -1, 5, 9], "users": [100, 0, 50, 60],
             "cold_users": 70, "cold_max_len": 3}  # fmt: skip
    (line, _) = rr._strata_sentence([{"strata_sizes": sizes}])
    assert line == (
        "Strata: Q0: 40 items seen 0-2 times in training, 100 test users; "
        "Q2: 10 items seen 3-5 times in training, 50 test users; "
        "Q3: 10 items seen 6-9 times in training, 60 test users; "
        "cold: 70 users with at most 3 training items."
    )


def test_reproduce_summary_refuses_runs_of_other_test_users(tmp_path):
    """A run whose ranks.npy covers other test users (e.g. one process's share of a DDP
    run) is refused by name: the paired differences would compare other users."""
    import argparse

    rr = _reproduce_rec()
    rng = np.random.default_rng(3)
    half = rng.integers(0, 30, USERS)
    half[1::2] = -1  # every second user missing
    fake_run(tmp_path, "t", "off", 0, rng.integers(0, 30, USERS), None)
    fake_run(tmp_path, "t", "on_frequency", 0, half, None)
    runs = rr.load_runs(tmp_path / "t", ["off", "on_frequency"])
    for run in runs.values():
        run["summary"].update(sec_per_epoch=1.0, epochs=3, best_epoch=2, tau=None)
    args = argparse.Namespace(dataset="d", backbone="b", tag="", loss_normalization="rows")
    with pytest.raises(ValueError, match=r"run \('on_frequency', 0\) ranked other test users"):
        rr.summarise(args, runs, [0], tmp_path)


def test_summary_marks_the_chosen_twins_as_tuned_with_their_paired_deltas(tmp_path):
    """summary.json: every row says tuned / noise / chosen_by; a selection adds two."""
    rng = np.random.default_rng(4)
    for table, val in (("beauty_sasrec_a", 0.04), ("beauty_sasrec_b", 0.05)):
        for variant in ("off", "on"):
            fake_run(tmp_path, table, variant, 0, rng.integers(0, 30, USERS), [val])
    res = tmp_path / "results"
    (res / "selected").mkdir(parents=True)
    cmd = [sys.executable, str(SCRIPT), "--runs-dir", str(tmp_path), "--seeds", "0",
           "--min-val-seeds", "1", "--off", "beauty_sasrec_a:off", "beauty_sasrec_b:off",
           "--on", "beauty_sasrec_a:on", "beauty_sasrec_b:on",
           "--out", str(res / "selected" / "beauty_sasrec_grid.md")]  # fmt: skip
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    fixed = {"dataset": "beauty", "backbone": "sasrec", "tag": "a", "variant": "off",
             "seeds": [0], "hr10": 0.1, "ndcg10": 0.05}  # fmt: skip
    (res / "beauty_sasrec_a.json").write_text(json.dumps([fixed]))
    _reproduce_rec().write_summary(res)
    rows = json.loads((res / "summary.json").read_text())
    assert all({"tuned", "noise", "chosen_by", "paired_delta_hr10_q0"} <= set(r) for r in rows)
    table_row = next(r for r in rows if r["tag"] == "a")
    assert table_row["tuned"] is False and table_row["noise"] == 0.0
    chosen = [r for r in rows if r["tuned"]]
    assert [r["variant"] for r in chosen] == ["off", "on"]
    assert all(r["setting"].startswith("beauty_sasrec_b:") for r in chosen)  # higher val
    sel = json.loads((res / "selected" / "beauty_sasrec_grid.json").read_text())["comparison"]
    on = chosen[1]
    assert (on["paired_delta_hr10"], on["paired_se_hr10"]) == tuple(sel["delta_hr10"])
    assert chosen[0]["paired_delta_hr10"] is None  # the off twin is the reference
