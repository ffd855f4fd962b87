"""How a trial or a study stops from outside: SIGTERM or Ctrl+C, turned into one
orderly stop (:func:`stops_on_signals`), and the exceptions that carry a stopped or
failed trial out of Optuna's objective. The study loop (:mod:`.study`) and a trial's
run (:mod:`.trial`) both use them."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["TrialFailed", "TrialInterrupted", "interrupt_seen", "stop_signal", "stops_on_signals"]


class TrialFailed(Exception):
    """Raised out of the objective so that Optuna records the trial as FAIL."""


class TrialInterrupted(Exception):
    """The trial was stopped from outside (SIGTERM, Ctrl+C): Optuna records it as FAIL
    without a reason (it does not count toward the budget), and the worker stops; the
    next run of the command retries it with its values, as it does a killed trial."""

    def __init__(self, number: int | None, how: str) -> None:
        what = f"trial {number}" if number is not None else "the study"
        super().__init__(f"{what} interrupted by {how}")
        self.number, self.how = number, how


_STOP: dict[str, str] = {}  # the signal that stopped this worker, once one has


def stop_signal() -> str:
    """How this worker was stopped: ``SIGTERM``, or ``Ctrl+C`` (SIGINT, also when no
    handler of :func:`stops_on_signals` saw it)."""
    return _STOP.get("how", "Ctrl+C")


def interrupt_seen() -> None:
    """The KeyboardInterrupt of :func:`stops_on_signals` reached code that handles it
    (Lightning's shutdown, a trial's or the worker's handler): no more are raised."""
    if _STOP and not _STOP.get("seen"):
        _STOP["seen"] = "yes"
        if hasattr(signal, "setitimer"):
            signal.setitimer(signal.ITIMER_REAL, 0)


@contextlib.contextmanager
def stops_on_signals() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl+C (a KeyboardInterrupt), wherever it lands: in a trial's
    fit (Lightning adds this handler after its own and shuts the run down), or between
    trials; Python's default would end the process at once, leaving a RUNNING trial.

    A KeyboardInterrupt raised where Python swallows it (a weakref or ``__del__``
    callback) would be lost, so it is raised again every second (SIGALRM) until
    :func:`interrupt_seen`; after that, further signals (a parent passing on what its
    process group already had) are ignored, so as not to cut the orderly stop short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP.clear()
    timer = hasattr(signal, "setitimer")

    def handler(signum: int, frame: Any) -> None:
        if _STOP.get("seen") or (_STOP and signum != getattr(signal, "SIGALRM", None)):
            return
        if not _STOP:
            _STOP["how"] = "SIGTERM" if signum == signal.SIGTERM else "Ctrl+C"
            if timer:
                signal.setitimer(signal.ITIMER_REAL, 1.0, 1.0)
        raise KeyboardInterrupt

    def unraisable(event: Any) -> None:  # the swallowed one is raised again: not shown
        if not (_STOP and isinstance(event.exc_value, KeyboardInterrupt)):
            hook(event)

    signals = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGALRM] if timer else [])
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield
    finally:
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
        sys.unraisablehook = hook
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
