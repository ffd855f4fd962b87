"""The study: its storage, sampler and pruner, and the loop that spends the budget.

The budget is a number of *finished* trials: complete, pruned, or failed with a
reason (a divergence, a refused value, out of memory). A trial whose process
was killed is not one of them: with an RDB storage (SQLite, PostgreSQL,
MySQL) every running trial writes a heartbeat, and the next worker to start
on the study marks a trial whose heartbeat stopped as failed and enqueues it
again with the same parameters (Optuna's ``RetryHeartbeatStaleTrialCallback``), so a
rerun of the same command retries it.

Several workers (processes, machines) share one study through its storage.
Before each trial a worker counts the finished and running trials; after it
draws a trial number, it checks that fewer than ``budget`` finished or running
trials come before it, so that workers racing for the last slot never run one
trial too many (the loser's trial is recorded as failed with the user attribute
``over_budget`` and left out of every count and table).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from bft_lightning.tuning.stopping import (
    TrialFailed,
    TrialInterrupted,
    interrupt_seen,
    stop_signal,
    stops_on_signals,
)

__all__ = [
    "CONFIG_ATTR",
    "HEARTBEAT_S",
    "counted",
    "fit_config_changes",
    "make_pruner",
    "make_sampler",
    "make_storage",
    "open_study",
    "run_worker",
]

HEARTBEAT_S = 10.0  # seconds between a running trial's heartbeats; stale after 3x
MAX_RETRY = 3  # a trial killed this many times is not enqueued again
CREATE_ATTEMPTS = 20  # opening a new database that other processes are creating too
PRUNERS = ("median", "asha", "hyperband", "none")


def make_storage(url: str, heartbeat: float = HEARTBEAT_S) -> Any:
    """An Optuna storage from a URL: ``sqlite:///file.db``, ``postgresql://...``,
    ``mysql://...`` (RDB, with heartbeats), or ``journal:FILE`` (Optuna's journal
    file, for file systems where SQLite locking is unreliable; no heartbeat)."""
    from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url.removeprefix("journal:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        raise ValueError(
            f"--storage {url}: not a storage URL (sqlite:///FILE.db, postgresql://..., "
            "mysql://..., or journal:FILE)"
        )
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    for attempt in range(CREATE_ATTEMPTS):
        try:
            return RDBStorage(
                url,
                heartbeat_interval=max(1, round(heartbeat)),
                grace_period=max(2, round(3 * heartbeat)),
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(
                    max_retry=MAX_RETRY
                ),
            )
        except ImportError as err:  # a driver (psycopg2, pymysql) that is not installed
            raise ValueError(f"--storage {url}: {err}") from None
        except (IntegrityError, OperationalError, ProgrammingError, StorageInternalError) as err:
            # Several processes opening one new database at once (workers, a second
            # machine, a monitor) race to create its tables and stamp its schema
            # version; the losers fail here (Optuna wraps some of these errors). The
            # winner's schema is there a moment later, so opening it again succeeds.
            cause = err.__cause__ if isinstance(err, StorageInternalError) else err
            racing = isinstance(cause, IntegrityError) or (
                isinstance(cause, (OperationalError, ProgrammingError))
                and any(text in str(cause) for text in ("locked", "already exists"))
            )
            if not racing or attempt == CREATE_ATTEMPTS - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def startup_trials(budget: int | None) -> int:
    """TPE's random trials before its model takes over: a third of the budget, from 3 to
    10 (Optuna's default, 10, would leave a study of 10 trials a pure random search)."""
    if budget is None:
        return 10
    return max(3, min(10, budget // 3))


def make_sampler(
    seed: int, trials_so_far: int = 0, worker: int = 0, budget: int | None = None
) -> optuna.samplers.BaseSampler:
    """TPE seeded from (``--sampler-seed``, the number of trials in the study, the worker),
    with :func:`startup_trials` random trials first.

    A new sampler for each trial: a study run straight through draws the same values
    for the same seed, while a rerun after a kill, or a second worker, does not restart
    the random stream at the first trial's values (a sampler seeded once per process
    would draw trial 0's values again).
    """
    state = np.random.SeedSequence([seed, trials_so_far, worker]).generate_state(1)[0]
    return optuna.samplers.TPESampler(seed=int(state), n_startup_trials=startup_trials(budget))


def prune_after_default(max_epochs: int | None) -> int:
    """The epochs a trial runs before it may be pruned when ``--prune-after`` is not
    given: a tenth of ``max_epochs`` (0 when it is unknown or under 10). A trial with a
    low learning rate starts slowly; judged at its first validation it would be pruned
    before it shows what it reaches, and the search would drift towards fast starters."""
    return max_epochs // 10 if max_epochs else 0


def make_pruner(
    name: str, budget: int, max_epochs: int | None, prune_after: int | None = None
) -> optuna.pruners.BasePruner:
    """``median``: stop a trial below the median of earlier trials at the same epoch
    (after the first ``min(5, budget // 4)`` trials, at least 1); ``asha``
    (successive halving) and ``hyperband`` over epochs 1..max_epochs; ``none``.
    No trial is pruned before epoch ``prune_after`` (default
    :func:`prune_after_default`): the median pruner's warm-up, the first rung of
    successive halving and Hyperband."""
    if prune_after is None:
        prune_after = prune_after_default(max_epochs)
    if prune_after < 0:
        raise ValueError(f"--prune-after must be >= 0 epochs, got {prune_after}")
    first = max(1, prune_after)
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=max(1, min(5, budget // 4)), n_warmup_steps=prune_after
        )
    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first, reduction_factor=3)
    if name == "hyperband":
        top = max_epochs if max_epochs and max_epochs > first else "auto"
        return optuna.pruners.HyperbandPruner(
            min_resource=first, max_resource=top, reduction_factor=3
        )
    raise ValueError(f"--pruner {name}: one of {', '.join(PRUNERS)}")


def open_study(name: str, storage: Any, direction: Any, sampler: Any, pruner: Any,
               meta: dict[str, Any], fit_config: str | None = None) -> optuna.Study:  # fmt: skip
    """Create or load the study; a loaded one must be of the same search and config.

    ``fit_config``, the resolved ``fit`` config of the base arguments, is stored with a
    study this command makes (user attribute ``bft_tune_config``): what its trials ran
    with, whatever the config files say later (:func:`fit_config_changes`)."""
    study = optuna.create_study(
        study_name=name, storage=storage, direction=direction, sampler=sampler, pruner=pruner,
        load_if_exists=True,
    )  # fmt: skip
    if study.direction.name.lower() != direction:
        raise ValueError(
            f"--study-name {name}: the stored study {study.direction.name.lower()}s; "
            f"this command's monitor wants {direction} (use another --study-name)"
        )
    saved = study.user_attrs.get("bft_tune")
    if saved is None:
        study.set_user_attr("bft_tune", meta)
        if fit_config is not None:
            study.set_user_attr(CONFIG_ATTR, fit_config)
    elif {k: saved.get(k) for k in meta} != meta:
        differ = sorted(k for k in meta if saved.get(k) != meta[k])
        raise ValueError(
            f"--study-name {name}: the stored study was made with another {', '.join(differ)} "
            f"({', '.join(f'{k}={saved.get(k)!r}' for k in differ)}); rerun it with the same "
            "command, or use another --study-name"
        )
    return study


CONFIG_ATTR = "bft_tune_config"


def fit_config_changes(
    made: str, now: str, limit: int = 4, reparse: Callable[[str], str] | None = None
) -> list[str]:
    """The settings on which two resolved ``fit`` configs (YAML) differ, as
    ``key: before -> now`` (at most ``limit``, then how many more).

    Compared as parsed values, not text (a dump's header names the Lightning version),
    and with their types (``limit_train_batches`` 1.0 is every batch, 1 is one). A
    setting only one side has is a change too: a callback added or removed, a scheduler
    where there was none. ``reparse`` resolves ``made`` again through the current parser
    first, so an option added to the code since takes its default on both sides; where
    that fails (an option it names was removed since), ``made`` is compared as stored.
    """
    import yaml

    if reparse is not None:
        with contextlib.suppress(Exception, SystemExit):
            made = reparse(made)

    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, dict) and node:
            out: dict[str, Any] = {}
            for k, v in node.items():
                out.update(flat(v, f"{prefix}{k}."))
            return out
        if isinstance(node, list) and any(isinstance(v, dict | list) for v in node):
            out = {}
            for i, v in enumerate(node):
                out.update(flat(v, f"{prefix}{i}."))
            return out
        return {prefix[:-1]: node}

    def text(value: Any) -> str:
        return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()

    try:
        stored = yaml.safe_load(made) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"the study's stored fit config does not parse as YAML ({err})") from None
    before, after = flat(stored), flat(yaml.safe_load(now) or {})
    absent = "(not set)"
    keys = sorted(
        k for k in before.keys() | after.keys()
        if k not in before or k not in after or text(before[k]) != text(after[k])
    )  # fmt: skip
    shown = [
        f"{k}: {text(before[k]) if k in before else absent} -> "
        f"{text(after[k]) if k in after else absent}"
        for k in keys[:limit]
    ]
    if len(keys) > limit:
        shown.append(f"and {len(keys) - limit} more")
    return shown


def counts(t: FrozenTrial) -> bool:
    """Whether a trial is spent budget (a killed trial's FAIL has no reason)."""
    if t.user_attrs.get("over_budget"):
        return False
    if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return t.state == TrialState.FAIL and bool(t.user_attrs.get("fail_reason"))


def counted(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if counts(t)]


class OverBudget(Exception):
    """This worker lost the race for the budget's last trial."""


def _fail_stale(study: optuna.Study) -> None:
    from optuna.storages import fail_stale_trials

    try:
        fail_stale_trials(study)
    except NotImplementedError:  # a storage without heartbeats
        pass


def _retry(study: optuna.Study, number: int | None) -> None:
    """Enqueue an interrupted trial again with its values (as a killed one is, through
    its stale heartbeat), at most ``MAX_RETRY`` times."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    if number is None:
        return
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)(study, frozen)


def run_worker(
    study: optuna.Study,
    budget: int,
    objective: Callable[[optuna.Trial], float],
    on_trial: Callable[[FrozenTrial], None],
    heartbeat: bool = True,
    seed: int = 0,
    worker: int = 0,
    poll: float = 2.0,
) -> None:
    """Run trials until ``budget`` finished trials are in the study.

    While the budget is covered by finished plus running trials (of this or other
    workers, or killed ones whose heartbeat has not yet gone stale), waits for them;
    without heartbeats (``journal:``) a running trial cannot be told from a killed
    one, and the worker stops instead.
    """

    current: dict[str, int] = {}

    def guarded(trial: optuna.Trial) -> float:
        current["number"] = trial.number
        ahead = [
            t for t in study.get_trials(deepcopy=False)
            if t.number < trial.number and (counts(t) or t.state == TrialState.RUNNING)
        ]  # fmt: skip
        if len(ahead) >= budget:
            trial.set_user_attr("over_budget", True)
            raise OverBudget
        return objective(trial)

    def report(study: optuna.Study, frozen: FrozenTrial) -> None:
        if not frozen.user_attrs.get("over_budget"):
            on_trial(frozen)

    with stops_on_signals():
        try:
            _run_until_budget(
                study, budget, guarded, report, heartbeat, seed, worker, poll, current
            )  # fmt: skip
        except TrialInterrupted as stop:  # FAIL without a reason: enqueued again
            interrupt_seen()
            _retry(study, stop.number)
            raise
        except KeyboardInterrupt:  # outside a trial's fit (its setup, or between trials)
            interrupt_seen()
            number = current.get("number")
            trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
            if (
                trial is not None and trial.state == TrialState.FAIL and not counts(trial)
                and trial.params and not trial.user_attrs.get("over_budget")
            ):  # fmt: skip
                _retry(study, trial.number)
            else:
                number = None
            raise TrialInterrupted(number, stop_signal()) from None


def _run_until_budget(
    study: optuna.Study, budget: int, guarded: Callable[[optuna.Trial], float],
    report: Callable[[optuna.Study, FrozenTrial], None], heartbeat: bool, seed: int,
    worker: int, poll: float, current: dict[str, int],
) -> None:  # fmt: skip

    while True:
        _fail_stale(study)
        trials = study.get_trials(deepcopy=False)
        done = sum(counts(t) for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        if done >= budget:
            return
        if done + running >= budget:
            if not heartbeat:
                return
            time.sleep(poll)
            continue
        study.sampler = make_sampler(seed, len(trials), worker, budget)
        study.optimize(guarded, n_trials=1, catch=(TrialFailed, OverBudget), callbacks=[report])
        current.clear()  # told: a signal from here on interrupts no trial
