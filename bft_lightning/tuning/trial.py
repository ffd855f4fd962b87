"""One trial: a ``fit`` run built and run by the ``fit`` command's own CLI.

The trial's command line is ``fit`` plus the study's ``--config`` files and
overrides plus the sampled values as overrides, so a trial is composed,
checked, logged and checkpointed exactly as ``python -m bft_lightning fit``
would do it; :class:`_TrialCLI` only adds the pruning callback and a
divergence check to the trainer. The run lands in its own folder (the
logger's ``version`` pinned to ``<study>_trial<N>``).

This is the one module of :mod:`bft_lightning.tuning` that imports
:mod:`bft_lightning.cli` (lazily, inside functions): a trial needs the
LightningCLI, the search space and the study do not.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from bft_lightning.tuning.stopping import interrupt_seen, stop_signal

__all__ = ["Plan", "Resume", "TrialResult", "compose", "plan_study", "resume_point", "run_trial"]


@dataclass
class Plan:
    """What every trial of a study shares, read once from the composed config."""

    base: list[str]  # --config files and overrides, as fit takes them
    monitor: str
    mode: str  # max | min
    save_dir: str  # the logger's folder ("logs"); tune's default storage lives below it
    versioned: bool  # whether the logger takes a version (the trial's run folder)
    max_epochs: int | None
    run_root: str | None = None  # the logger's save_dir/name: the trials' run folders' parent


@dataclass
class Resume:
    """Where a retried trial picks up its interrupted attempt: that attempt's run folder
    (``run_dir``; the logger's ``version`` is its name) and ``last.ckpt``, and what it had
    validated (the recorder's ``(epoch, value)`` pairs and the pruner's intermediate
    values, step = epoch - 1), and the seconds it had trained (0 for an attempt killed
    outright, which could not record them)."""

    run_dir: str
    ckpt: str
    validations: list[tuple[int, float]]
    intermediate: dict[int, float]
    seconds: float = 0.0

    @property
    def version(self) -> str:
        return Path(self.run_dir).name


@dataclass
class TrialResult:
    state: str  # complete | pruned | fail | interrupted
    value: float | None = None
    reason: str | None = None
    kind: str | None = None  # fail: diverged | out_of_memory | refused | error
    attrs: dict[str, Any] = field(default_factory=dict)


def _interruption(err: BaseException | None) -> str | None:
    """``SIGTERM`` or ``Ctrl+C`` when ``err`` is how Lightning stops a run on that signal."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    if isinstance(err, SIGTERMException):
        return "SIGTERM"
    if isinstance(err, KeyboardInterrupt):  # SIGTERM too, in a study (stopping.stops_on_signals)
        return stop_signal()
    return None


def _parse_only_class() -> type:
    from bft_lightning.cli import BFTCLI

    class _Parsed(Exception):
        pass

    class ParseOnly(BFTCLI):
        """Parses (all of ``fit``'s checks of the command line), instantiates nothing."""

        def before_instantiate_classes(self) -> None:
            raise _Parsed(self)

    ParseOnly.Parsed = _Parsed  # type: ignore[attr-defined]
    return ParseOnly


def compose(argv: list[str]) -> tuple[Any, Any]:
    """(``fit``'s parser, the composed config) of ``fit`` + ``argv``; nothing is built."""
    from bft_lightning.cli import main

    klass = _parse_only_class()
    try:
        with _quiet(None):
            main(["fit", *argv], exit_on_error=False, cli_class=klass)
    except klass.Parsed as done:  # type: ignore[attr-defined]
        cli = done.args[0]
        return cli._parser("fit"), cli.config["fit"]
    raise RuntimeError("the fit command line was not parsed")  # pragma: no cover


def config_yaml(argv: list[str]) -> str:
    """The complete config of ``fit`` + ``argv``, as ``fit --config`` reads it back."""
    parser, config = compose(argv)
    return str(parser.dump(config, skip_none=False))


def _callbacks(config: Any) -> list[tuple[str, Any]]:
    out = []
    for cb in config.get("trainer", {}).get("callbacks") or []:
        path = str(cb.get("class_path", "")) if hasattr(cb, "get") else type(cb).__name__
        out.append((path.rsplit(".", 1)[-1], cb.get("init_args") if hasattr(cb, "get") else cb))
    return out


def plan_study(base: list[str], monitor: str | None) -> Plan:
    """Read the metric ``fit`` stops and checkpoints on, its mode, and the run folders.

    ``monitor`` None: the metric of the config's ``ModelCheckpoint`` (else its
    ``EarlyStopping``, else ``val/ndcg@10``). A ``monitor`` given must agree with
    the checkpoint's: the trial's best checkpoint and its value are that metric's.
    """
    _, config = compose(base)
    watched = [
        (name, str(args.get("monitor")), str(args.get("mode") or "min"))
        for name, args in _callbacks(config)
        if name in ("ModelCheckpoint", "EarlyStopping") and args is not None and args.get("monitor")
    ]
    checkpoint = next((w for w in watched if w[0] == "ModelCheckpoint"), None)
    if monitor is not None and checkpoint is not None and checkpoint[1] != monitor:
        raise ValueError(
            f"--monitor {monitor}: the config's ModelCheckpoint monitors {checkpoint[1]}; a "
            "trial's best checkpoint and value would be chosen on another metric than the "
            "study's (change the config's callbacks, or leave --monitor out)"
        )
    chosen = checkpoint or (watched[0] if watched else None)
    name = monitor or (chosen[1] if chosen else "val/ndcg@10")
    mode = chosen[2] if chosen and chosen[1] == name else ("min" if "loss" in name else "max")
    if mode not in ("min", "max"):
        raise ValueError(f"the config's {chosen[0] if chosen else 'callback'} mode {mode!r}")
    if not name.startswith("val"):
        raise ValueError(
            f"--monitor {name}: trials are compared and pruned on a validation metric "
            "(val/...), logged at each validation"
        )
    trainer = config.get("trainer", {})
    logger = trainer.get("logger")
    logger = logger[0] if isinstance(logger, list) and logger else logger
    init = logger.get("init_args") if hasattr(logger, "get") else None
    save_dir = str(init.get("save_dir")) if init is not None and init.get("save_dir") else "logs"
    versioned = init is not None and "version" in init
    max_epochs = trainer.get("max_epochs")
    # the loggers' default name is "lightning_logs", and None is "" (save_dir/version)
    folder = (init.get("name") or "") if init is not None and "name" in init else "lightning_logs"
    run_root = str(Path(save_dir) / str(folder)) if versioned else None
    every = trainer.get("check_val_every_n_epoch") or 1
    if max_epochs is not None and 0 < max_epochs < every:
        raise ValueError(
            f"trainer.max_epochs={max_epochs} ends every trial before its first validation "
            f"(check_val_every_n_epoch={every}): no {name} to compare or prune on"
        )
    return Plan(list(base), name, mode, save_dir, versioned, max_epochs, run_root)


def check_keys(plan: Plan, space: Any) -> None:
    """Parse the config with every parameter of the space at each of its probe values.

    An option the model does not have, or a value of the wrong type, stops the study
    here, before any trial, with the space file's line of that key.
    """
    rounds = max(len(p.probe_values()) for p in space.params)
    for i in range(rounds):
        values = {p.key: p.probe_values()[i % len(p.probe_values())] for p in space.params}
        message = _refusal([*plan.base, *space.overrides(values)])
        if message is None:
            continue
        culprit = next((p for p in space.params if _names(message, p.key)), None)
        if culprit is None:  # locate it: one key at a time
            culprit = next(
                (p for p in space.params
                 if _refusal([*plan.base, *space.overrides({p.key: values[p.key]})])),
                None,
            )  # fmt: skip
        unknown = re.search(r"Option '([^']+)' is not accepted", message)
        if unknown:
            message = f"not an option of the model or data (fit's parser: {unknown.group(0)})"
        where = culprit.where() if culprit else space.path
        shown = f" = {values[culprit.key]!r}" if culprit and not unknown else ""
        raise ValueError(f"{where}{shown}: the fit command line refuses it: {message}")


def _refusal(argv: list[str]) -> str | None:
    """Why fit's parser refuses ``argv`` (one line), or None."""
    from jsonargparse import ArgumentError

    from bft_lightning.utils.errors import one_line

    try:
        compose(argv)
    except (ArgumentError, ValueError) as err:
        return one_line(err)
    except SystemExit as err:
        return str(err.code)
    return None


def _names(message: str, key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return key in message or f'"{last}"' in message or f"--{key}" in message


def resume_point(plan: Plan, attempt: Any) -> Resume | None:
    """Where a retry of ``attempt`` (the interrupted or killed trial it repeats, a frozen
    trial) picks up: that attempt's run folder and ``last.ckpt``, when both exist and the
    folder is one this study's runs land in (the same logger folder); else None, and the
    retry trains from the start."""
    run_dir = attempt.user_attrs.get("run_dir")
    if not plan.versioned or plan.run_root is None or not run_dir:
        return None
    folder = Path(run_dir)
    ckpt = folder / "checkpoints" / "last.ckpt"
    if not ckpt.is_file() or folder.parent.resolve() != Path(plan.run_root).resolve():
        return None
    validations = [(int(e), float(v)) for e, v in attempt.user_attrs.get("validations") or []]
    intermediate = {int(k): float(v) for k, v in attempt.intermediate_values.items()}
    if not validations:  # a killed attempt that never saved its history: the pruner's
        validations = [(step + 1, value) for step, value in sorted(intermediate.items())]
    seconds = float(attempt.user_attrs.get("seconds") or 0.0)
    return Resume(str(run_dir), str(ckpt), validations, intermediate, seconds)


class _TrialRecorder(Callback):
    """Each validation's value of the monitor; a non-finite loss or metric ends the trial."""

    def __init__(self, monitor: str, trial: Any = None, earlier: list | None = None) -> None:
        self.monitor = monitor
        self.trial = trial
        self.values: list[tuple[int, float]] = list(earlier or [])
        self.carried = {epoch for epoch, _ in self.values}  # a resumed run may validate again

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and not bool(loss.detach().isfinite().all()):
            raise FloatingPointError(
                f"diverged: training loss {float(loss.detach().float().mean())} at epoch "
                f"{trainer.current_epoch}, step {trainer.global_step}"
            )

    def on_validation_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        value = float(value)
        if not math.isfinite(value):
            raise FloatingPointError(
                f"diverged: {self.monitor} = {value} at epoch {pl_module.current_epoch}"
            )
        epoch = int(pl_module.current_epoch) + 1  # epochs from 1
        if epoch in self.carried:  # validated again after a resume: the new value stands
            self.carried.discard(epoch)
            self.values = [ev for ev in self.values if ev[0] != epoch]
        self.values.append((epoch, value))
        if self.trial is not None and trainer.is_global_zero:  # the history so far, also
            self.trial.set_user_attr("validations", self.values)  # for a killed trial


def _trial_cli_class(extra: list[Callback]) -> type:
    from bft_lightning.cli import BFTCLI

    class TrialCLI(BFTCLI):
        def instantiate_trainer(self, **kwargs: Any) -> Any:
            trainer = super().instantiate_trainer(**kwargs)
            trainer.callbacks.extend(extra)  # type: ignore[attr-defined]
            return trainer

    return TrialCLI


def run_trial(
    trial: Any,
    plan: Plan,
    overrides: list[str],
    version: str,
    prune: bool,
    log: Path,
    resume: Resume | None = None,
) -> TrialResult:
    """``fit`` with the trial's values; every outcome is a :class:`TrialResult`.

    What ``fit`` prints goes to ``log`` (Lightning's info messages are held back),
    so that the study prints one line per trial. With ``resume`` (a retry of an
    interrupted trial, :func:`resume_point`), the run continues that attempt's run
    folder from its ``last.ckpt`` (``fit --ckpt_path``: weights, optimizer, epoch,
    early-stopping and best-checkpoint state), and the trial carries the attempt's
    validations and, for the pruner, its intermediate values."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as stream, _quiet(stream):
        result = _run_trial(trial, plan, overrides, version, prune, resume)
        if resume is not None and result.attrs.get("resume_failed"):
            # the checkpoint did not load (or fit refused it): trained from the start
            print(f"could not resume from {resume.ckpt}: {result.reason}", flush=True)
            print("training from the start", flush=True)
            trial.set_user_attr("resumed_from", None)
            result = _run_trial(trial, plan, overrides, version, prune, None)
        return result


@contextlib.contextmanager
def _quiet(stream: Any) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(stream) if stream is not None else contextlib.nullcontext():
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _run_trial(
    trial: Any,
    plan: Plan,
    overrides: list[str],
    version: str,
    prune: bool,
    resume: Resume | None = None,
) -> TrialResult:
    import optuna

    from bft_lightning.cli import main

    recorder = _TrialRecorder(plan.monitor, trial, resume.validations if resume else None)
    extra: list[Callback] = [recorder]
    if resume is not None:
        version = resume.version
        trial.set_user_attr("resumed_from", resume.ckpt)
        trial.set_user_attr("run_dir", resume.run_dir)  # kept should this try stop early
        last = resume.validations[-1][0] if resume.validations else 0
        print(f"resuming from {resume.ckpt} (validated up to epoch {last})", flush=True)
    if prune:
        from optuna_integration import PyTorchLightningPruningCallback

        extra.append(PyTorchLightningPruningCallback(trial, monitor=plan.monitor))
    argv = ["fit", *plan.base, *overrides, "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false"]  # fmt: skip
    if plan.versioned:
        argv.append(f"--trainer.logger.init_args.version={version}")
    if resume is not None:
        argv.append(f"--ckpt_path={resume.ckpt}")
    start = time.monotonic()
    cli = None
    holder: dict[str, Any] = {}

    class Keep(Callback):  # the trainer, even when fit stops with an exception
        def setup(self, trainer, pl_module, stage):  # type: ignore[no-untyped-def]
            holder["trainer"] = trainer
            if trainer.log_dir:
                trial.set_user_attr("run_dir", str(trainer.log_dir))

        def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            # the checkpoint (if any) is restored by now
            holder["started"] = True
            if resume is not None:  # the pruner judges the whole run, as if unbroken
                for step, value in sorted(resume.intermediate.items()):
                    trial.report(value, step)

        def on_exception(self, trainer, pl_module, exception):  # type: ignore[no-untyped-def]
            # Lightning turns Ctrl+C into sys.exit(1): the signal is only seen here
            holder["interrupted"] = _interruption(exception)
            if holder["interrupted"]:
                interrupt_seen()

    extra.append(Keep())
    result: TrialResult
    try:
        cli = main(argv, exit_on_error=False, cli_class=_trial_cli_class(extra))
        result = TrialResult("complete")
    except optuna.TrialPruned as err:
        result = TrialResult("pruned", reason=str(err) or "pruned")
    except (Exception, SystemExit, KeyboardInterrupt) as err:  # noqa: BLE001 - a trial result
        how = _interruption(err) or holder.get("interrupted")
        if how:
            interrupt_seen()
        if how is None and isinstance(err, KeyboardInterrupt):
            raise
        result = TrialResult("interrupted", reason=how) if how else _failure(err)
    trainer = cli.trainer if cli is not None else holder.get("trainer")
    if resume is not None and result.state == "fail" and not holder.get("started"):
        result.attrs["resume_failed"] = True
        return result
    best = _best(trainer, plan, recorder)
    # the whole run's time: a resumed trial adds its interrupted attempt's
    spent = time.monotonic() - start + (resume.seconds if resume is not None else 0.0)
    result.attrs.update(best, seconds=round(spent, 1))
    if result.state == "complete":
        if best.get("best_value") is None:
            return TrialResult(
                "fail", reason=f"no {plan.monitor} was logged (no validation ran?)",
                kind="refused", attrs=result.attrs,
            )  # fmt: skip
        result.value = best["best_value"]
    return result


def _failure(err: BaseException) -> TrialResult:
    """A FAIL with its one-line reason and kind: ``diverged`` (non-finite loss or metric),
    ``out_of_memory``, ``refused`` (a value the model or fit's checks refuse) or ``error``."""
    from bft_lightning.utils.errors import one_line

    if isinstance(err, FloatingPointError):
        return TrialResult("fail", reason=str(err), kind="diverged")
    if isinstance(err, SystemExit):  # fit's own launch checks
        return TrialResult("fail", reason=str(err.code), kind="refused")
    text = one_line(err)
    if isinstance(err, MemoryError) or "out of memory" in text.lower():
        return TrialResult("fail", reason=f"out of memory: {text}", kind="out_of_memory")
    if isinstance(err, ValueError | TypeError) or type(err).__name__ == "ArgumentError":
        return TrialResult("fail", reason=text, kind="refused")
    return TrialResult("fail", reason=f"{type(err).__name__}: {text}", kind="error")


def _best(trainer: Any, plan: Plan, recorder: _TrialRecorder) -> dict[str, Any]:
    """The run folder, best checkpoint, its epoch and value of the monitor."""
    out: dict[str, Any] = {"validations": recorder.values}
    if trainer is not None and trainer.log_dir:
        out["run_dir"] = str(trainer.log_dir)
    if recorder.values:
        pick = max if plan.mode == "max" else min
        epoch, value = pick(recorder.values, key=lambda ev: ev[1])
        out.update(best_epoch=epoch, best_value=value)
    for cb in getattr(trainer, "checkpoint_callbacks", []) or []:
        if getattr(cb, "monitor", None) == plan.monitor and cb.best_model_path:
            out["best_ckpt"] = str(cb.best_model_path)
            if cb.best_model_score is not None:
                out["best_value"] = float(cb.best_model_score)
    return out
