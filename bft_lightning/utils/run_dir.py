"""Which run folder a command writes into: ``--ckpt_path last`` continues the run it names.

A logger such as ``TensorBoardLogger(save_dir="logs", name="quick")`` opens a
new ``logs/quick/version_N`` folder on every start, and Lightning looks for
``last`` only in that new, empty folder: ``fit --ckpt_path last`` would start
from scratch. :func:`pin_run` resolves the checkpoint first and pins the
logger's ``version`` to the folder it lies in, so that

- ``fit --ckpt_path last`` continues the newest run under ``save_dir/name``
  (newest ``*/checkpoints/last*.ckpt``) in that run's own folder (logs,
  checkpoints, metrics); with no checkpoint yet it says so and starts a new run;
- ``validate/test/predict --ckpt_path last|best`` evaluate the newest run's
  ``last``/``best`` checkpoint and write their tables into that run's folder
  (no checkpoint: an error, never an evaluation of untrained weights);
- an explicit ``--ckpt_path <save_dir>/<name>/<run>/checkpoints/X.ckpt``
  writes into ``<run>`` too.

Only loggers configured with ``class_path`` and a ``save_dir`` are pinned, and
never over a ``version`` the config sets itself (``last``/``best`` are then
looked for in that run); checkpoint callbacks with
their own ``dirpath`` are left to Lightning's own ``last`` lookup.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["pin_run"]


def _get(ns: Any, key: str, default: Any = None) -> Any:
    getter = getattr(ns, "get", None)
    return getter(key, default) if callable(getter) else default


def _logger_args(trainer: Any) -> Any:
    logger = _get(trainer, "logger")
    if isinstance(logger, list):
        logger = logger[0] if logger else None
    if logger is None or isinstance(logger, bool):
        return None
    init = _get(logger, "init_args")
    if init is None or _get(init, "save_dir") is None:
        return None
    return init


def _own_dirpath(trainer: Any) -> bool:
    """Whether a checkpoint callback writes to a folder of its own (not the run's)."""
    for callback in _get(trainer, "callbacks") or []:
        if _get(_get(callback, "init_args"), "dirpath") is not None:
            return True
    return False


def _say(text: str) -> None:
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
        print(text, flush=True)


def pin_run(config: Any, subcommand: str) -> None:
    """Resolve ``config.ckpt_path`` (``last``/``best``/a run's file) and pin the logger version."""
    ckpt = _get(config, "ckpt_path")
    trainer = _get(config, "trainer")
    init = _logger_args(trainer) if trainer is not None else None
    if ckpt is None or init is None:
        return
    root = Path(str(_get(init, "save_dir"))) / str(_get(init, "name") or "")
    pinned = _get(init, "version") is not None
    if str(ckpt) in ("last", "best"):
        if _own_dirpath(trainer):
            return  # Lightning finds `last` in that folder itself
        name = str(ckpt)
        version = _get(init, "version")
        run = (
            "*"
            if version is None
            else (version if isinstance(version, str) else f"version_{version}")
        )
        found = [p for p in root.glob(f"{run}/checkpoints/{name}*.ckpt") if p.is_file()]
        path = max(found, key=lambda p: p.stat().st_mtime) if found else None
        if path is None:
            where = f"{root}/{run}/checkpoints/{name}*.ckpt"
            if subcommand == "fit" and name == "last":
                _say(f"--ckpt_path last: no checkpoint yet ({where}): starting a new run")
                config["ckpt_path"] = None
                return
            raise SystemExit(
                f"error: --ckpt_path {name}: no checkpoint found ({where}); pass the file "
                "with --ckpt_path PATH"
            )
        config["ckpt_path"] = str(path)
        if not pinned:
            init["version"] = path.parent.parent.name
        if subcommand == "fit":
            _say(f"resuming {path} in {path.parent.parent}")
        return
    path = Path(str(ckpt))
    if "://" in str(ckpt) or pinned or path.parent.name != "checkpoints":
        return
    try:
        same = path.parent.parent.parent.resolve() == root.resolve()
    except OSError:
        return
    if same:
        init["version"] = path.parent.parent.name
