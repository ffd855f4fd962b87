"""bench/tune_twins.py: both twins' studies share everything but their files, and the
whole pipeline (two studies, retraining with seeds, the paired table) on synthetic data."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "tune_twins.py"
sys.path.insert(0, str(SCRIPT.parent))
import tune_twins as tt  # noqa: E402

TINY = [
    "--override=--trainer.limit_train_batches=4", "--override=--trainer.limit_val_batches=1",
    "--override=--trainer.check_val_every_n_epoch=1",
    "--override=--data.init_args.synthetic_users=600",
    "--override=--data.init_args.synthetic_items=200",
]  # fmt: skip


def _args(tmp: Path) -> argparse.Namespace:
    return argparse.Namespace(
        dataset="synthetic", backbone="sasrec", trials=5, pruner="asha", sampler_seed=3,
        jobs=1, max_epochs=7, data_root="/data", storage_dir=str(tmp / "tune"),
        runs_dir=str(tmp / "runs"), noise=0.1, accelerator=None, loss_normalization="targets",
        override=["--trainer.limit_train_batches=4"],
    )  # fmt: skip


def test_the_twins_studies_differ_only_in_their_files(tmp_path: Path) -> None:
    args = _args(tmp_path)
    off, on = tt.study_args(args, "off"), tt.study_args(args, "on")
    differ = [(a, b) for a, b in zip(off, on, strict=True) if a != b]
    assert all("off" in a and "on" in b for a, b in differ)
    assert len(differ) == 5  # config, search space, storage, study name, report folder
    for shared in ("--sampler-seed", "--trials", "--pruner"):
        assert off[off.index(shared) + 1] == on[on.index(shared) + 1]
    # the studies search on the clean data; the noise is in the retrainings only
    assert "--data.init_args.train_noise=0.1" not in off and "--trainer.max_epochs=7" in off
    best = {"values": {"model.init_args.lr": 0.01}}
    assert "--data.init_args.train_noise=0.1" in tt.retrain_args(args, best).override
    assert off[off.index("--search") + 1].endswith("configs/search/sasrec_off.yaml")


@pytest.mark.slow
def test_tune_twins_end_to_end(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(SCRIPT), "--dataset", "synthetic", "--backbone", "sasrec",
        "--trials", "2", "--seeds", "0", "1", "--max-epochs", "2",
        "--results-dir", str(tmp_path / "res"), "--runs-dir", str(tmp_path / "runs"), *TINY,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # one twin's study and retraining alone first (as a second process would run it)
    done = subprocess.run([*cmd, "--retrain-only", "on"], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = sorted(p.name for p in (tmp_path / "runs").glob("synthetic_sasrec_t2/*"))
    assert runs == ["tuned_on_s0", "tuned_on_s1"]
    # retrained from the config the study stored (with the tiny overrides it ran with)
    stored = tmp_path / "runs" / "synthetic_sasrec_t2" / "tuned_on_s0" / "study_config.yaml"
    assert "limit_train_batches: 4" in stored.read_text()
    assert not (tmp_path / "res" / "tuned").exists()  # no comparison until both are done
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = tmp_path / "res"
    assert (res / "tune" / "synthetic_sasrec_off.db").is_file()
    assert (res / "tune" / "synthetic_sasrec_on" / "best.yaml").is_file()
    doc = json.loads((res / "tuned" / "synthetic_sasrec.json").read_text())
    every = json.loads((res / "summary.json").read_text())
    # one row per twin and evaluation convention (both counted from the same runs)
    assert {r["protocol"] for r in every} == {"seen_masked", "unmasked"}
    summary = [r for r in every if r["protocol"] == "seen_masked"]
    rows = [r for r in doc["summary_rows"] if r["protocol"] == "seen_masked"]
    assert [r["variant"] for r in summary] == ["off", "on"] == [r["variant"] for r in rows]
    on = summary[1]
    assert on["tuned"] is True and on["trials"] == 2 and on["seeds"] == [0, 1]
    for key in ("paired_delta_hr10", "paired_se_hr10", "paired_delta_hr10_q0",
                "paired_delta_hr10_cold", "paired_delta_ndcg10"):  # fmt: skip
        assert isinstance(on[key], float), key
    assert summary[0]["paired_delta_hr10"] is None
    assert on["setting"] == doc["studies"]["on"]["values"]
    assert set(doc["studies"]["off"]["values"]) < set(on["setting"]) | {
        "model.init_args.num_negatives"
    }  # the on twin searched the off twin's options and its own
    assert "## The studies" in (res / "tuned" / "synthetic_sasrec.md").read_text()
    assert {b["retrained_from"] for b in doc["studies"].values()} == {"the study's config"}


def test_status_reads_the_studies_without_running_them(tmp_path: Path) -> None:
    import optuna

    args = _args(tmp_path)
    (tmp_path / "tune").mkdir()
    name = tt.study_name(args, "off")
    study = optuna.create_study(
        study_name=name, storage=f"sqlite:///{tmp_path / 'tune' / name}.db", direction="maximize"
    )
    study.set_user_attr("bft_tune", {"monitor": "val/ndcg@10"})
    dist = optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    for lr, value in [(1e-3, 0.05), (3e-3, 0.07)]:
        study.add_trial(optuna.trial.create_trial(
            params={"model.init_args.lr": lr}, distributions={"model.init_args.lr": dist},
            value=value, user_attrs={"best_epoch": 4},
        ))  # fmt: skip
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING))
    lines = tt.status(args)
    assert lines[0].startswith(
        "off: 2/5 trials finished (2 complete, 0 pruned, 0 failed), 1 running"
    )
    assert "best so far: trial 1, val/ndcg@10 0.0700 (lr=0.003)" in lines[0]
    assert lines[1].startswith("on: no study yet")
    table = (tmp_path / "tune" / name / "trials.md").read_text()
    assert table.count("| COMPLETE |") == 2


def test_retraining_reads_the_config_the_study_ran_with(tmp_path: Path) -> None:
    """A study stores its resolved fit config; the retrainings read that, not the
    files, so a default changed since the study cannot move its chosen values onto
    another model or data. The stored text parses as the retraining's ``--config``
    (without ``fit``'s own ``ckpt_path``) and keeps its values."""
    import yaml

    from bft_lightning.cli import main as cli_main
    from bft_lightning.tuning.trial import config_yaml

    made_with = config_yaml([
        "--config", str(SCRIPT.parents[1] / "configs/experiments/sasrec_off_synthetic.yaml"),
        "--data.init_args.max_len=13", "--data.init_args.synthetic_users=300",
    ])  # fmt: skip
    assert "ckpt_path" in yaml.safe_load(made_with)
    text = tt.retrain_config(made_with)
    assert text is not None and set(yaml.safe_load(text)) == set(tt.RETRAIN_SECTIONS)
    assert tt.retrain_config(None) is None
    args = _args(tmp_path)
    best = {"values": {"model.init_args.lr": 0.01}, "fit_config": text}
    retrain = tt.retrain_args(args, best)
    assert retrain.base_config == text
    (tmp_path / "study_config.yaml").write_text(text)
    cli = cli_main(
        ["--config", str(tmp_path / "study_config.yaml"), "--trainer.logger=false",
         *[o for o in retrain.override if "limit_train" not in o]],
        run=False,
    )  # fmt: skip
    assert cli.datamodule.hparams.max_len == 13  # the study's, not the file's 50
    assert cli.model.hparams.lr == 0.01  # the chosen value on top
    # a run trained from a study's config is not reused by one from the files
    files = tt.retrain_args(args, {"values": best["values"]})
    assert files.base_config is None
    import reproduce_rec as rr

    assert rr._settings(retrain) != rr._settings(files)
