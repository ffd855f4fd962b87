"""Checks of constructor options that name the option.

Each raises ``ValueError("<name> must be ..., got ...")``.

Each public constructor checks the options it declares, before it builds
anything, so a bad value stops with the option's name rather than a shape
error (or a silent wrong result) deep inside torch. Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int = 1, optional: bool = False) -> None:
    """An integer ``>= low`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if not _is_int(value) or value < low:  # type: ignore[operator]
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be an integer >= {low}{none}, got {value!r}")


def check_number(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
) -> None:
    """A finite number in the interval ``[low, high]`` (ends open as asked)."""
    if optional and value is None:
        return
    ok = _is_number(value) and math.isfinite(value)  # type: ignore[arg-type]
    if ok and low is not None:
        ok = value > low if low_open else value >= low  # type: ignore[operator]
    if ok and high is not None:
        ok = value < high if high_open else value <= high  # type: ignore[operator]
    if not ok:
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be {_interval(low, high, low_open, high_open)}{none}, "
                         f"got {value!r}")  # fmt: skip


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return "a finite number"


def check_dropout(name: str, value: object) -> None:
    """A dropout probability: in ``[0, 1)`` (1 would drop everything)."""
    check_number(name, value, 0.0, 1.0, high_open=True)


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    """One of ``choices``."""
    options = tuple(choices)
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


def check_heads(d_model: int, nhead: int, name: str = "nhead", width: str = "d_model") -> None:
    """``nhead`` a positive integer that divides the width (the error names ``nhead``)."""
    check_int(name, nhead)
    if d_model % nhead:
        raise ValueError(f"{name} must divide {width}={d_model}, got {name}={nhead}")


def check_sizes(**sizes: object) -> None:
    """Every size a positive integer (None where the option allows it is not passed)."""
    for name, value in sizes.items():
        check_int(name, value)


def check_filter_options(
    dropout: object, q_init: object, nu0: object, sill_momentum: object, eps: object,
    eps_name: str = "layer_norm_eps",
) -> None:  # fmt: skip
    """The options every BFT layer shares.

    ``q_init`` is the initial process noise ``Q0`` (a variance, ``Q = softplus(rho)``,
    so ``lambda'' <= 1 / Q``): it must be > 0. ``nu0`` counts the sill prior's
    pseudo-observations (>= 0); ``sill_momentum`` is a lerp weight in [0, 1].
    """
    check_dropout("dropout", dropout)
    check_number("q_init", q_init, 0.0, low_open=True)
    check_number("nu0", nu0, 0.0)
    check_number("sill_momentum", sill_momentum, 0.0, 1.0)
    check_number(eps_name, eps, 0.0, low_open=True)
