"""An interrupted trial's retry continues its run from the last checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState
from tune_helpers import CONFIG, tiny, tune, write

from bft_lightning.tuning.study import counts
from bft_lightning.tuning.trial import Plan, resume_point

LR = "model.init_args.lr"


def _args(tmp: Path, marker: Path) -> list[str]:
    space = write(tmp / "space.yaml", f"{LR}: {{type: float, low: 5.0e-3, high: 2.0e-2}}\n")
    stop = {"class_path": "tune_helpers.StopOnce", "init_args": {"marker": str(marker), "at": 2}}
    return [
        "--config", CONFIG, "--search", str(space), "--trials", "1",
        "--storage", f"sqlite:///{tmp}/study.db", "--study-name", "s", "--pruner", "median",
        "--out", str(tmp / "out"), *tiny(tmp), "--max-epochs", "4",
        f"--trainer.callbacks+={json.dumps(stop)}",
    ]  # fmt: skip


def _epochs(marker: Path) -> list[int]:
    return [int(line) for line in Path(f"{marker}.epochs").read_text().split()]


def _interrupted(tmp: Path, args: list[str], capsys: pytest.CaptureFixture) -> FrozenTrial:
    code, _, err = tune(args, capsys)
    assert code == 130, err
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp}/study.db")
    return study.get_trials()[0]


def test_retry_resumes_the_interrupted_run_and_keeps_its_history(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    marker = tmp_path / "stopped"
    args = _args(tmp_path, marker)
    code, _, err = tune(args, capsys)
    assert code == 130, err
    assert "trial 0 interrupted by Ctrl+C" in err
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/study.db")
    cut = study.get_trials()[0]
    assert cut.state == TrialState.FAIL and not counts(cut)
    assert [e for e, _ in cut.user_attrs["validations"]] == [1, 2]
    assert sorted(cut.intermediate_values) == [0, 1]  # what the pruner saw
    run_dir = Path(cut.user_attrs["run_dir"])
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()

    code, out, err = tune(args, capsys)
    assert code == 0, err
    assert "resumed from its last checkpoint" in out
    trials = optuna.load_study(
        study_name="s", storage=f"sqlite:///{tmp_path}/study.db"
    ).get_trials()
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == 0)
    assert retry.state == TrialState.COMPLETE and retry.params == cut.params
    assert Path(retry.user_attrs["run_dir"]) == run_dir  # the same run folder, continued
    assert retry.user_attrs["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt")
    # the second run trained epochs 2 and 3 only, where the first had stopped
    assert _epochs(marker) == [0, 1, 2, 3]
    validations = retry.user_attrs["validations"]
    assert [e for e, _ in validations] == [1, 2, 3, 4]
    assert validations[:2] == cut.user_attrs["validations"]  # the first run's, carried over
    assert sorted(retry.intermediate_values) == [0, 1, 2, 3]  # the pruner's whole history
    assert retry.value == pytest.approx(max(v for _, v in validations), abs=1e-6)
    assert retry.user_attrs["best_epoch"] == max(validations, key=lambda ev: ev[1])[0]
    # its time is the whole run's: the interrupted attempt's seconds and its own
    assert cut.user_attrs["seconds"] > 0
    assert retry.user_attrs["seconds"] > cut.user_attrs["seconds"]


def test_no_resume_without_a_checkpoint_or_from_another_folder(tmp_path: Path) -> None:
    """A retry starts over when the attempt left no last.ckpt, or when its run folder is
    not under this study's logger folder (another save_dir or logger name)."""
    root = tmp_path / "logs" / "trials"
    plan = Plan([], "val/ndcg@10", "max", str(tmp_path / "logs"), True, 4, str(root))
    ckpt = root / "s_trial000" / "checkpoints" / "last.ckpt"

    class Attempt:
        user_attrs = {"run_dir": str(root / "s_trial000"), "validations": [[1, 0.1]],
                      "seconds": 12.5}  # fmt: skip
        intermediate_values = {0: 0.1}

    assert resume_point(plan, Attempt()) is None  # no checkpoint yet
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"x")
    point = resume_point(plan, Attempt())
    assert point is not None and point.version == "s_trial000" and point.ckpt == str(ckpt)
    assert point.validations == [(1, 0.1)] and point.intermediate == {0: 0.1}
    assert point.seconds == 12.5
    elsewhere = Plan([], "val/ndcg@10", "max", str(tmp_path / "other"), True, 4,
                     str(tmp_path / "other" / "trials"))  # fmt: skip
    assert resume_point(elsewhere, Attempt()) is None
    unversioned = Plan([], "val/ndcg@10", "max", str(tmp_path / "logs"), False, 4, None)
    assert resume_point(unversioned, Attempt()) is None

    class Killed:  # killed outright: no history of its own, the pruner's values stand in
        user_attrs = {"run_dir": str(root / "s_trial000")}
        intermediate_values = {0: 0.1, 1: 0.2}

    killed = resume_point(plan, Killed())
    assert killed.validations == [(1, 0.1), (2, 0.2)] and killed.seconds == 0.0


def test_a_checkpoint_that_does_not_load_is_trained_again_from_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    marker = tmp_path / "stopped"
    args = _args(tmp_path, marker)
    cut = _interrupted(tmp_path, args, capsys)
    last = Path(cut.user_attrs["run_dir"]) / "checkpoints" / "last.ckpt"
    last.write_bytes(b"not a checkpoint")
    code, out, err = tune(args, capsys)
    assert code == 0, err
    assert "resumed from its last checkpoint" not in out
    trials = optuna.load_study(
        study_name="s", storage=f"sqlite:///{tmp_path}/study.db"
    ).get_trials()
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == 0)
    assert retry.state == TrialState.COMPLETE and counts(retry)
    assert not retry.user_attrs.get("resumed_from")
    assert Path(retry.user_attrs["run_dir"]).name.endswith(f"_trial{retry.number:03d}")
    assert _epochs(marker) == [0, 1, 0, 1, 2, 3]  # all four epochs, from the start
    assert [e for e, _ in retry.user_attrs["validations"]] == [1, 2, 3, 4]
    assert "could not resume" in Path(retry.user_attrs["log"]).read_text()
