"""Lightning's and torch's configuration errors as one line naming the option.

``Trainer(devices=0)``, ``max_epochs=-5``, ``accelerator="gpu"`` without a GPU,
or a restored epoch beyond ``max_epochs`` raise Lightning's
``MisconfigurationException`` (or a ``TypeError``) from deep inside the
trainer, which is not a bad-input error to the command line and so reached
the user as a traceback. :func:`translate` turns such an error into a
``ValueError`` whose message starts with the option (``--trainer.devices=0:
...``); :func:`check_trainer_options` refuses the values that Lightning
accepts but then fails on with an unrelated error (``val_check_interval=0``:
a ``ZeroDivisionError`` mid-run).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

__all__ = ["check_trainer_options", "is_configuration_error", "translate"]

# words in Lightning's messages that name an option without spelling it
_ALIASES = {
    "gpu backend": "accelerator",
    "accelerator": "accelerator",
    "current_epoch": "max_epochs",
}


def _trainer_options() -> list[str]:
    from lightning.pytorch import Trainer

    return [p for p in inspect.signature(Trainer.__init__).parameters if p != "self"]


def is_configuration_error(err: BaseException) -> bool:
    """Lightning's ``MisconfigurationException`` (what it raises for a bad option)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    return isinstance(err, MisconfigurationException)


def option_named(message: str, options: list[str] | None = None) -> str | None:
    """The trainer option a Lightning message is about, or None."""
    options = options if options is not None else _trainer_options()
    set_in = re.search(r"Trainer\((\w+)=", message)
    if set_in and set_in.group(1) in options:
        return set_in.group(1)
    for name in re.findall(r"`(\w+)`", message):
        if name in options:
            return name
    for word in re.findall(r"[a-z_]+", message):
        if word in options and "_" in word:
            return word
    low = message.lower()
    return next((opt for key, opt in _ALIASES.items() if key in low), None)


def translate(err: BaseException, trainer: dict[str, Any] | None = None) -> ValueError | None:
    """A one-line ``ValueError`` naming the trainer option of ``err``; None if it names none.

    ``trainer`` is the trainer's configuration (for the value the user gave).
    """
    message = " ".join(str(err).split())
    option = option_named(message)
    if option is None:
        return None
    value = (trainer or {}).get(option) if hasattr(trainer, "get") else None
    shown = f"--trainer.{option}" + ("" if value is None else f"={value}")
    return ValueError(f"{shown}: {message}")


def check_trainer_options(trainer: Any) -> None:
    """Refuse values Lightning accepts at first but then fails on obscurely."""
    get = getattr(trainer, "get", None)
    if not callable(get):
        return
    checks = (
        ("val_check_interval", lambda v: v is None or (not isinstance(v, bool) and v > 0),
         "must be > 0 (a fraction of an epoch, or a number of batches)"),
        ("check_val_every_n_epoch", lambda v: v is None or (isinstance(v, int) and v >= 1),
         "must be an integer >= 1 or null"),
        ("accumulate_grad_batches", lambda v: v is None or (isinstance(v, int) and v >= 1),
         "must be an integer >= 1"),
        ("num_nodes", lambda v: v is None or (isinstance(v, int) and v >= 1),
         "must be an integer >= 1"),
        ("log_every_n_steps", lambda v: v is None or (isinstance(v, int) and v >= 1),
         "must be an integer >= 1"),
    )  # fmt: skip
    for name, ok, rule in checks:
        value = get(name)
        try:
            good = ok(value)
        except TypeError:
            good = False
        if not good:
            raise ValueError(f"--trainer.{name}={value}: {rule}")
