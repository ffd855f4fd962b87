"""``python -m bft_lightning tune --config X.yaml --search SPACE.yaml --trials N [fit overrides]``.

Runs a study of ``fit`` trials (docs/tune.md): every option that ``fit`` takes
after the tune options (or after ``--``) is passed to each trial, e.g.
``--trainer.max_epochs=4``. Prints a line per trial and, at the end, the best
trial; writes ``best.yaml``, ``trials.md``/``trials.csv``, ``history.png`` and
``importances.png`` into ``--out``.

Exit status: 0 when at least one trial completed; 2 for a bad input (a config,
an override, the search space, a storage URL; also when every trial failed on a
value the model refused); 1 when no trial completed for another reason (every
trial diverged, ran out of memory, was pruned or crashed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["main", "parser"]

PROG = "python -m bft_lightning tune"
INSTALL = "pip install 'bft-lightning[tune]'  (optuna, optuna-integration)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --config CONFIG.yaml --search SPACE.yaml [--trials N] [options] "
        "[-- fit overrides]",
        description="Search fit's options with Optuna; every trial is a fit run (docs/tune.md). "
        "Options tune does not know (e.g. --trainer.max_epochs=4) go to every trial's fit.",
    )
    p.add_argument("--config", action="append", required=True, help="as fit's; repeat to layer")
    p.add_argument("--search", required=True, help="the search space (configs/search/*.yaml)")
    p.add_argument("--trials", type=int, default=20, help="budget: finished trials (20)")
    p.add_argument(
        "--storage", default=None,
        help="an Optuna storage URL: sqlite:///FILE.db (default: <log folder>/tune/<study>.db), "
        "postgresql://..., mysql://..., or journal:FILE",
    )  # fmt: skip
    p.add_argument("--study-name", default=None, help="default: <config>-<search> file stems")
    p.add_argument("--pruner", choices=("median", "asha", "hyperband", "none"), default="median")
    p.add_argument(
        "--prune-after", type=int, default=None, metavar="EPOCHS",
        help="no trial is pruned before this epoch (default: a tenth of max_epochs)",
    )  # fmt: skip
    p.add_argument("--sampler-seed", type=int, default=0, help="TPE's seed (0)")
    p.add_argument("--workers", type=int, default=1, help="trials side by side on this machine")
    p.add_argument("--monitor", default=None, help="default: the config's checkpoint metric")
    p.add_argument("--out", default=None, help="report folder (default: <log folder>/tune/<study>)")
    p.add_argument("--max-epochs", type=int, default=None, help="= --trainer.max_epochs")
    p.add_argument("--heartbeat", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _pruner_text(opts: argparse.Namespace, max_epochs: int | None) -> str:
    """The pruner and its warm-up, as the first line says it."""
    from bft_lightning.tuning.study import prune_after_default

    if opts.pruner == "none":
        return "none"
    after = opts.prune_after if opts.prune_after is not None else prune_after_default(max_epochs)
    return f"{opts.pruner} (no pruning before epoch {after})" if after else opts.pruner


def _split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Tune's own options, and the fit overrides (unknown options, and all after ``--``)."""
    after: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, after = argv[:cut], argv[cut + 1 :]
    opts, extra = parser().parse_known_args(argv)
    if extra and not extra[0].startswith("--"):  # a value with no option before it
        parser().error(f"unrecognized arguments: {' '.join(extra)}")
    if opts.trials < 1:
        parser().error(f"--trials must be >= 1, got {opts.trials}")
    if opts.prune_after is not None and opts.prune_after < 0:
        parser().error(f"--prune-after must be >= 0 epochs, got {opts.prune_after}")
    if opts.workers < 1:
        parser().error(f"--workers must be >= 1, got {opts.workers}")
    return opts, [*extra, *after]


def main(argv: list[str] | None = None) -> int:
    """Run ``tune``; returns the exit status. A bad input raises (``ValueError``,
    ``SystemExit`` with a message): the command line prints it on one line, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        import optuna  # noqa: F401
        import optuna_integration  # noqa: F401
    except ImportError as err:
        print(f"error: tune needs {err.name}: {INSTALL}", file=sys.stderr)
        return 2
    opts, overrides = _split(argv)
    return _tune(opts, overrides, argv)


def _tune(opts: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    import optuna

    from bft_lightning.tuning import report
    from bft_lightning.tuning.space import load_space
    from bft_lightning.tuning.stopping import TrialInterrupted
    from bft_lightning.tuning.study import (
        CONFIG_ATTR,
        HEARTBEAT_S,
        counted,
        fit_config_changes,
        make_pruner,
        make_sampler,
        make_storage,
        open_study,
        run_worker,
    )
    from bft_lightning.tuning.trial import check_keys, config_yaml, plan_study

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    space = load_space(opts.search)
    base = [a for c in opts.config for a in ("--config", c)] + overrides
    if opts.max_epochs is not None:
        base.append(f"--trainer.max_epochs={opts.max_epochs}")
    plan = plan_study(base, opts.monitor)
    if not opts.worker_only:  # the workers of --workers N: checked by their parent
        check_keys(plan, space)
    name = opts.study_name or f"{Path(opts.config[-1]).stem}-{Path(opts.search).stem}"
    url = opts.storage or f"sqlite:///{Path(plan.save_dir) / 'tune' / name}.db"
    heartbeat = opts.heartbeat or HEARTBEAT_S
    storage = make_storage(url, heartbeat)
    direction = "maximize" if plan.mode == "max" else "minimize"
    meta = {"search": space.fingerprint(), "fit_args": plan.base, "monitor": plan.monitor}
    fit_config = None if opts.worker_only else config_yaml(plan.base)  # workers: the parent's
    study = open_study(
        name, storage, direction, make_sampler(opts.sampler_seed),
        make_pruner(opts.pruner, opts.trials, plan.max_epochs, opts.prune_after), meta,
        fit_config,
    )  # fmt: skip
    made_with = study.user_attrs.get(CONFIG_ATTR)
    changes = ""
    if fit_config is not None and made_with is not None and made_with != fit_config:
        changes = "; ".join(
            fit_config_changes(made_with, fit_config, reparse=lambda t: _reparse(t, config_yaml))
        )
    if changes:
        if len(counted(study)) < opts.trials:
            raise ValueError(
                f"--study-name {name}: the fit config has changed since the study was made "
                f"({changes}), so its next trials would not be comparable with its earlier "
                "ones; restore those settings, or use another --study-name"
            )
        print(
            f"tune: the fit config has changed since study {name} was made ({changes}); "
            "its trials are done, and best.yaml keeps the config they ran with",
            flush=True,
        )
    out = Path(opts.out or Path(plan.save_dir) / "tune" / name)
    if not opts.worker_only:
        print(
            f"tune: study {name} in {url}: {opts.trials} trials, {direction} {plan.monitor}, "
            f"pruner {_pruner_text(opts, plan.max_epochs)}, "
            f"{len(space.searched())} parameters searched",
            flush=True,
        )
    try:
        if opts.workers > 1:
            _spawn(argv, opts.workers, url)
        else:
            objective = _objective(study, space, plan, name, out, prune=opts.pruner != "none")
            run_worker(
                study, opts.trials, objective,
                lambda t: print(report.progress_line(t, plan.monitor), flush=True),
                heartbeat=not url.startswith("journal:"), seed=opts.sampler_seed,
                worker=opts.worker_index,
            )  # fmt: skip
    except TrialInterrupted as stop:
        if opts.worker_only:  # about to exit: the parent may pass the signal on again
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if stop.number is not None:
            retried = "the trial is retried with its values, "
        elif opts.workers > 1:
            retried = "the workers' interrupted trials are retried with their values, "
        else:
            retried = ""
        print(
            f"tune: {stop}; the study stops here. Rerun the same command to continue: "
            f"{retried}the budget is unchanged",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        return 143 if stop.how == "SIGTERM" else 130
    if opts.worker_only:
        return 0
    return _finish(study, space, plan, out, config_yaml, made_with)


def _objective(study: Any, space: Any, plan: Any, name: str, out: Path, prune: bool) -> Any:
    import optuna
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    from bft_lightning.tuning.stopping import TrialFailed, TrialInterrupted
    from bft_lightning.tuning.trial import resume_point, run_trial

    def objective(trial: optuna.Trial) -> float:
        frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
        retry_of = RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)
        values = space.sample(trial)
        trial.set_user_attr("values", values)
        trial.set_user_attr("retry_of", retry_of)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        for key in ("fail_reason", "fail_kind", "best_ckpt", "best_epoch", "best_value",
                    "validations", "resumed_from", "run_dir", "seconds"):  # fmt: skip
            if key in frozen.user_attrs:  # a retry starts with the killed trial's attributes
                trial.set_user_attr(key, None)
        log = out / "trial_logs" / f"trial{trial.number:03d}.log"
        trial.set_user_attr("log", str(log))
        resume = None
        if retry_of is not None:  # the latest attempt's run goes on from its last.ckpt
            history = RetryHeartbeatStaleTrialCallback.retry_history(frozen) or [retry_of]
            attempt = next(
                (t for t in study.get_trials(deepcopy=False) if t.number == history[-1]), None
            )
            if attempt is not None:  # same params: Optuna's retry copies them
                resume = resume_point(plan, attempt)
        result = run_trial(
            trial,
            plan,
            space.overrides(values),
            f"{name}_trial{trial.number:03d}",
            prune,
            log,
            resume,
        )
        for key, value in result.attrs.items():
            trial.set_user_attr(key, value)
        if result.state == "pruned":
            trial.set_user_attr("pruned", result.reason)
            raise optuna.TrialPruned(result.reason)
        if result.state == "interrupted":  # not spent budget: retried by the next run
            trial.set_user_attr("fail_kind", "interrupted")
            raise TrialInterrupted(trial.number, result.reason or "a signal")
        if result.state == "fail":
            trial.set_user_attr("fail_reason", result.reason)
            trial.set_user_attr("fail_kind", result.kind)
            raise TrialFailed(result.reason)
        assert result.value is not None
        return result.value

    return objective


def _spawn(argv: list[str], workers: int, url: str) -> None:
    """``workers`` copies of this command, each with ``cores // workers`` threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, (cores or 1) // workers))
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    args, skip = [], False
    for i, a in enumerate(argv):  # this command without --workers N / --workers=N
        if skip:
            skip = False
        elif a == "--":
            args += argv[i:]
            break
        elif a == "--workers":
            skip = True
        elif not a.startswith("--workers="):
            args.append(a)
    command = [sys.executable, "-m", "bft_lightning", "tune", "--worker-only", "--storage", url]
    procs = [
        subprocess.Popen([*command, "--worker-index", str(i), *args], env=env)
        for i in range(workers)
    ]
    from bft_lightning.tuning.stopping import (
        TrialInterrupted,
        interrupt_seen,
        stop_signal,
        stops_on_signals,
    )

    try:
        with stops_on_signals():
            codes = [p.wait() for p in procs]
    except KeyboardInterrupt:  # Ctrl+C to the group, or a signal to this process alone
        interrupt_seen()
        how = stop_signal()
        for p in procs:  # each worker stops on its first signal and ignores a second
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGINT)
        deadline = time.monotonic() + 120
        for p in procs:  # their running trials are recorded as interrupted and re-queued
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.poll() is None:
                p.kill()
        raise TrialInterrupted(None, how) from None
    if any(codes):
        raise SystemExit(f"error: a worker of the study ended with exit status {max(codes)}")


def _reparse(text: str, config_yaml: Any, *overrides: str) -> str:
    """A stored config (YAML) resolved again by the current parser, with ``overrides``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "made_with.yaml").write_text(text, encoding="utf-8")
        return str(config_yaml(["--config", str(Path(tmp) / "made_with.yaml"), *overrides]))


def _finish(
    study: Any, space: Any, plan: Any, out: Path, config_yaml: Any, made_with: str | None
) -> int:
    """The report; ``best.yaml`` is the best trial's values over ``made_with``, the config
    the study was made with (stored with it), or over the base arguments for a study made
    before that was stored or whose options no longer parse."""
    from optuna.trial import TrialState

    from bft_lightning.tuning import report
    from bft_lightning.tuning.study import counted

    out.mkdir(parents=True, exist_ok=True)
    trials = counted(study)
    for line in report.best_lines(study, plan.monitor, [p.key for p in space.params]):
        print(line, flush=True)
    report.write_tables(study, out, plan.monitor)
    for note in report.write_plots(study, out):
        print(note, flush=True)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        values = best.user_attrs.get("values") or best.params
        text = None
        if made_with is not None:
            try:
                text = _reparse(made_with, config_yaml, *space.overrides(values))
            except (Exception, SystemExit) as err:  # noqa: BLE001 - an option since removed
                from bft_lightning.utils.errors import one_line

                print(
                    f"tune: the config the study was made with no longer parses "
                    f"({one_line(err)}); best.yaml is over the current files",
                    flush=True,
                )
        if text is None:
            text = config_yaml([*plan.base, *space.overrides(values)])
        head = (
            f"# study {study.study_name}, trial {best.number}: {plan.monitor} = {best.value:.4f}\n"
            f"# python -m bft_lightning fit --config {out / 'best.yaml'}\n"
        )
        (out / "best.yaml").write_text(head + text)
        print(f"wrote {out / 'best.yaml'}, trials.md, trials.csv, history.png to {out}", flush=True)
        return 0
    failed = [t for t in trials if t.state == TrialState.FAIL]
    if failed and len(failed) == len(trials):
        kinds = {t.user_attrs.get("fail_kind") for t in failed}
        print(f"all {len(failed)} trials failed (reasons above and in {out / 'trials.md'})")
        return 2 if kinds == {"refused"} else 1
    print(f"no trial completed ({len(trials)} finished: see {out / 'trials.md'})")
    return 1
