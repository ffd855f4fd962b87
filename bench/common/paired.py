"""Paired statistics: a mean with its standard error, and the mean of paired differences
(the same test users, or the same questions under the same seed) with its standard error.

The standard error is ``sd(x, ddof=1) / sqrt(n)``; pairing removes the spread between
users (or questions) from the difference's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def mean_se(x: Sequence[float] | np.ndarray, single: Any = math.nan) -> tuple[float, Any]:
    """Mean of ``x`` and its standard error; ``single`` is the SE of fewer than two values."""
    a = np.asarray(x, dtype=float)
    return float(a.mean()), (float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else single)


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of the per-user difference ``b - a``."""
    return mean_se(np.asarray(b) - np.asarray(a))


def hits(ranks: np.ndarray, k: int = 10) -> np.ndarray:
    """Per user, 1 when the target's 0-based rank is within the top ``k`` (HR@k)."""
    return (ranks < k).astype(float)


def ndcg(ranks: np.ndarray, k: int = 10) -> np.ndarray:
    """Per user, NDCG@k of the one target at its 0-based rank."""
    return np.where(ranks < k, 1.0 / np.log2(ranks + 2.0), 0.0)


def paired_runs(
    runs: list[dict],
    method: str,
    reference: str,
    noise: float,
    k: int,
    values: Callable[[dict], dict[str, float]],
    empty: Any = math.nan,
) -> tuple[Any, Any, int]:
    """Mean per-question difference ``method - reference``, its standard error and the
    number of pairs, over every run of ``method`` at label noise ``noise`` with ``k``
    distractors and the ``reference`` run of the same condition and seed (the same
    questions). ``values`` gives a run's value per question; ``empty`` is the mean and SE
    when no run has its reference."""
    diffs: list[float] = []
    for run in runs:
        if (run["method"], run["noise_rate"], run["distractors"]) != (method, noise, k):
            continue
        key = (reference, noise, k, run["seed"])
        ref = next(
            (r for r in runs if (r["method"], r["noise_rate"], r["distractors"], r["seed"]) == key),
            None,
        )
        if ref is None:
            continue
        va, vb = values(run), values(ref)
        diffs += [va[q] - vb[q] for q in va]
    if not diffs:
        return empty, empty, 0
    return (*mean_se(diffs), len(diffs))
