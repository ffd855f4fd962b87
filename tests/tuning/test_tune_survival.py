"""A study outlives ``kill -9`` of its tuner, and several workers share one study."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from tune_helpers import CONFIG, REPO, tiny, tune_process, write

from bft_lightning.tuning.study import counts

pytestmark = pytest.mark.slow

SPACE = "model.init_args.lr: {type: float, low: 1.0e-3, high: 1.0e-2, log: true}\n"


def _args(tmp: Path, trials: int) -> list[str]:
    space = write(tmp / "space.yaml", SPACE)
    return [
        "--config", CONFIG, "--search", str(space), "--trials", str(trials),
        "--storage", f"sqlite:///{tmp}/study.db", "--study-name", "s", "--pruner", "none",
        "--heartbeat", "1", "--out", str(tmp / "out"), *tiny(tmp),
        "--data.init_args.batch_size=8", "--trainer.limit_train_batches=60",
    ]  # fmt: skip


def _study(tmp: Path) -> optuna.Study:
    return optuna.load_study(study_name="s", storage=f"sqlite:///{tmp}/study.db")


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM", "SIGINT"])
def test_killed_tuner_rerun_retries_the_killed_trial_and_keeps_the_rest(
    sig: str, tmp_path: Path
) -> None:
    """Killed outright, the trial is left RUNNING and retried once its heartbeat is
    stale; stopped by SIGTERM or Ctrl+C, the study stops at once (143, 130) with the
    trial failed without a reason (not spent budget) and enqueued again."""
    args = _args(tmp_path, trials=3)
    proc = tune_process(args, REPO, tmp_path / "first.log")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # kill it in the middle of its second trial
        time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "first.log").read_text()
        if not (tmp_path / "study.db").exists():
            continue
        try:
            trials = _study(tmp_path).get_trials()
        except Exception:  # noqa: BLE001 - the study is being created
            continue
        if any(t.number == 1 and t.state == TrialState.RUNNING for t in trials):
            time.sleep(1.0)
            break
    os.kill(proc.pid, getattr(signal, sig))
    code = proc.wait(timeout=120)
    before = {t.number: t for t in _study(tmp_path).get_trials()}
    assert before[0].state == TrialState.COMPLETE
    if sig == "SIGKILL":
        assert before[1].state == TrialState.RUNNING
    else:
        first_log = (tmp_path / "first.log").read_text()
        assert code == {"SIGTERM": 143, "SIGINT": 130}[sig], first_log
        assert f"trial 1 interrupted by {'SIGTERM' if sig == 'SIGTERM' else 'Ctrl+C'}" in first_log
        assert "Traceback" not in first_log
        assert before[1].state == TrialState.FAIL and not counts(before[1])
        assert before[1].user_attrs.get("fail_kind") == "interrupted"
        assert sorted(before) == [0, 1, 2] and before[2].state == TrialState.WAITING

    rerun = tune_process(args, REPO, tmp_path / "rerun.log")
    rerun.wait(timeout=300)
    output = (tmp_path / "rerun.log").read_text()
    assert rerun.returncode == 0, output
    trials = _study(tmp_path).get_trials()
    done = [t for t in trials if counts(t)]
    assert len(done) == 3  # the budget: finished trials only
    killed = next(t for t in trials if t.number == 1)
    assert killed.state == TrialState.FAIL and "fail_reason" not in killed.user_attrs
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == 1)
    assert retry.params == killed.params and retry.state == TrialState.COMPLETE
    first = next(t for t in trials if t.number == 0)
    assert first.datetime_complete == before[0].datetime_complete  # not run again
    assert sum(t.params == first.params for t in trials) == 1
    assert "(retry of trial 1)" in output


def test_two_workers_share_one_study_and_stop_at_the_budget(tmp_path: Path) -> None:
    args = _args(tmp_path, trials=4)
    proc = tune_process([*args, "--workers", "2"], REPO, tmp_path / "tune.log")
    proc.wait(timeout=400)
    output = (tmp_path / "tune.log").read_text()
    assert proc.returncode == 0, output
    trials = _study(tmp_path).get_trials()
    done = [t for t in trials if counts(t)]
    assert len(done) == 4 and len({t.number for t in done}) == 4
    assert all(t.state == TrialState.COMPLETE for t in done)
    progress = [line.split()[1] for line in output.splitlines() if line.startswith("trial ")]
    assert sorted(progress) == sorted(str(t.number) for t in done)  # one line per trial
    pids = {t.user_attrs.get("worker") for t in done}
    assert len(pids) == 2  # both workers ran trials
    assert (tmp_path / "out" / "best.yaml").is_file()


def test_ctrl_c_to_two_workers_interrupts_both_trials_and_requeues_them(tmp_path: Path) -> None:
    """Ctrl+C to the group (parent and both workers): each worker records its running
    trial as interrupted (not spent budget) and re-queues it; the parent waits for them,
    exits 130 without a traceback, and a rerun finishes the budget."""
    import subprocess
    import sys

    args = [*_args(tmp_path, trials=4), "--workers", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = tmp_path / "tune.log"
    with open(log, "w") as stream:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bft_lightning", "tune", *args], cwd=REPO, env=env,
            stdout=stream, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # both workers in a trial
            time.sleep(0.5)
            assert proc.poll() is None, log.read_text()
            try:
                trials = _study(tmp_path).get_trials()
            except Exception:  # noqa: BLE001 - the study is being created
                continue
            if sum(t.state == TrialState.RUNNING for t in trials) == 2:
                time.sleep(3.0)
                break
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert code == 130, output
    assert "Traceback" not in output
    trials = _study(tmp_path).get_trials()
    cut = [t for t in trials if t.state == TrialState.FAIL]
    assert len(cut) == 2 and all(t.user_attrs.get("fail_kind") == "interrupted" for t in cut)
    assert not any(counts(t) for t in cut)
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    # every interrupted trial's values wait to be retried. A set, not a list: a worker
    # between trials when the signal lands may take the retry the other worker has just
    # queued (its query held up by that worker's lock on the database) and be cut in it;
    # both cuts then carry the same values, and the one queued retry covers them
    assert {str(t.params) for t in waiting} == {str(t.params) for t in cut}
    assert len(waiting) <= len(cut)
    assert not any(t.state == TrialState.RUNNING for t in trials)


def test_journal_storage_runs_a_study(tmp_path: Path) -> None:
    args = _args(tmp_path, trials=2)
    args[args.index("--storage") + 1] = f"journal:{tmp_path / 'study.log'}"
    proc = tune_process(args, REPO, tmp_path / "tune.log")
    proc.wait(timeout=300)
    output = (tmp_path / "tune.log").read_text()
    assert proc.returncode == 0, output
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.log"))
    )
    trials = optuna.load_study(study_name="s", storage=storage).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert trials[0].params != trials[1].params
