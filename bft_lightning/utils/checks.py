"""Type checks for API arguments that Python would otherwise take by truthiness.

``exclude_seen="no"`` is a non-empty string, so it is true; ``k=10.0`` or
``batch_size="64"`` would fail later with an unrelated message. The public
API checks such arguments where they enter, naming the argument.
"""

from __future__ import annotations

import numpy as np

__all__ = ["check_bool", "check_int"]


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is a ``bool`` (numpy's too); else ``ValueError`` naming ``name``."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def check_int(value: object, name: str, low: int | None = None, high: int | None = None) -> int:
    """``value`` if it is an integer (not a bool) in ``[low, high]``; else ``ValueError``."""
    ok = not isinstance(value, bool) and isinstance(value, int | np.integer)
    if ok and low is not None and value < low:  # type: ignore[operator]
        ok = False
    if ok and high is not None and value > high:  # type: ignore[operator]
        ok = False
    if not ok:
        bounds = (
            f" in {low}..{high}" if low is not None and high is not None
            else f" >= {low}" if low is not None else ""
        )  # fmt: skip
        raise ValueError(f"{name} must be an integer{bounds}, got {value!r}")
    return int(value)  # type: ignore[call-overload]
