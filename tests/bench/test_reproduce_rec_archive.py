"""A finished run's archive (results/rec/runs/...) rebuilds the same table after its run
folder is gone, under both evaluation conventions; older runs keep their one convention."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import reproduce_rec as rr  # noqa: E402


def _run(out: Path, seed: int, protocols: list[str] | None) -> None:
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    ranks = rng.integers(0, 50, 40)
    np.save(out / "ranks.npy", ranks)
    if protocols is not None:
        np.save(out / "ranks_seen_masked.npy", np.maximum(ranks - 3, 0))
    np.save(out / "targets.npy", rng.integers(1, 30, 40))
    np.save(out / "history_len.npy", rng.integers(1, 20, 40))
    np.save(out / "item_frequency.npy", np.arange(31))
    summary = {"variant": "off", "seed": seed, "metrics": {}, "sec_per_epoch": 1.0,
               "settings": {"override": ["--model.init_args.mask_history=true"]}}  # fmt: skip
    if protocols is not None:
        summary["protocols"] = protocols
    (out / "summary.json").write_text(json.dumps(summary))


def test_archive_rebuilds_the_runs_without_their_folders(tmp_path):
    base, results = tmp_path / "runs" / "toy_sasrec_x", tmp_path / "results"
    _run(base / "off_s0", 0, ["seen_masked", "unmasked"])
    _run(base / "off_s1", 1, None)  # an older run: one ranks.npy, masked by its override
    for out in sorted(base.iterdir()):
        rr.archive_run(out, results)
    here = rr.load_runs(base, ["off"])
    shutil.rmtree(base)
    base.mkdir()
    archived = rr.load_runs(base, ["off"], results)
    assert set(archived) == set(here) == {("off", 0), ("off", 1)}
    for key, run in here.items():
        got = archived[key]
        assert set(got["ranks_by_protocol"]) == set(run["ranks_by_protocol"])
        for protocol, ranks in run["ranks_by_protocol"].items():
            assert np.array_equal(got["ranks_by_protocol"][protocol], ranks)
        assert np.array_equal(got["targets"], run["targets"])
        assert got["summary"] == run["summary"]
    assert set(archived[("off", 0)]["ranks_by_protocol"]) == {"seen_masked", "unmasked"}
    assert set(archived[("off", 1)]["ranks_by_protocol"]) == {"seen_masked"}
    assert set(rr.by_protocol(archived)) == {"seen_masked"}  # the convention both runs kept


def _args(results: Path, override: list[str]) -> argparse.Namespace:
    return argparse.Namespace(
        results_dir=str(results), max_epochs=100, override=override,
        loss_normalization="rows", accelerator=None,
    )  # fmt: skip


def test_a_seed_archived_elsewhere_is_not_trained_again(tmp_path, monkeypatch):
    """On a machine without the run folder, the committed archive is the finished run:
    run_one returns it and trains nothing; a command with other settings is refused."""
    base, results = tmp_path / "runs" / "toy_sasrec_x", tmp_path / "results"
    _run(base / "off_s0", 0, ["seen_masked", "unmasked"])
    args = _args(results, ["--model.init_args.mask_history=true"])
    summary = json.loads((base / "off_s0" / "summary.json").read_text())
    summary["settings"] = rr._settings(args)
    (base / "off_s0" / "summary.json").write_text(json.dumps(summary))
    rr.archive_run(base / "off_s0", results)
    shutil.rmtree(base)

    def no_training(*a, **k):  # noqa: ANN002, ANN003
        raise AssertionError("an archived seed was trained again")

    monkeypatch.setattr(rr, "cli_main", no_training)
    assert rr.run_one(args, "off", 0, base / "off_s0") == summary
    other = _args(results, ["--model.init_args.mask_history=false"])
    with pytest.raises(SystemExit, match="other settings"):
        rr.run_one(other, "off", 0, base / "off_s0")


def test_archived_config_names_no_path_of_this_machine(tmp_path):
    """Paths in and beside the repository (the data next to it) become relative to it."""
    from common.runs import ROOT

    base, results = tmp_path / "runs" / "toy_sasrec_x", tmp_path / "results"
    _run(base / "off_s0", 0, ["seen_masked", "unmasked"])
    (base / "off_s0" / "tb" / "version_0").mkdir(parents=True)
    (base / "off_s0" / "tb" / "version_0" / "config.yaml").write_text(
        f"config: {ROOT}/configs/experiments/x.yaml\ndata_root: {ROOT.parent}/shared/data\n"
    )
    rr.archive_run(base / "off_s0", results)
    text = (results / "runs" / "toy_sasrec_x" / "off_s0" / "config.yaml").read_text()
    assert text == "config: configs/experiments/x.yaml\ndata_root: ../shared/data\n"
