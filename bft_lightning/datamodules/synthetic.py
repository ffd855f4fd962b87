"""A built-in synthetic sequential-recommendation dataset (no files, seeded).

Generative story, all drawn from ``numpy.random.default_rng(seed)``:

- Item popularity is Zipf: item ``i`` (1-based rank) has weight ``i ** -zipf_a``.
- Items fall into ``num_clusters`` random clusters. Each item has
  ``branching`` successors in its own cluster (drawn by popularity) with
  Dirichlet transition weights: a sparse first-order Markov chain.
- Each user prefers one cluster. The first item comes from that cluster by
  popularity; each next item follows the current item's Markov successors
  with probability ``p_follow``, else comes from the user's cluster by
  popularity with probability ``p_cluster``, else from global popularity.
- Lengths are ``min_len + floor(lognormal)`` (default) or ``min_len`` plus a
  geometric tail of mean ``mean_len - min_len`` (``lengths="geometric"``),
  capped at ``max_seq_len``: many short histories and a long tail.
- Timestamps start in 2020 and increase by at least one second per step
  (exponential gaps with a one-day mean), so time-aware models can use them.

The Markov structure makes the data learnable: a bigram recommender beats
popularity by a wide margin (see ``tests/datamodules/test_datamodule_synthetic.py``).

Generation is vectorised and linear in users, items and interactions (each
popularity draw is a binary search of one cumulative array; each step walks
only the users whose history is that long; timings in
``results/perf/scale_train.md``). Earlier versions (up to the
losses module) drew from ``(users x items)`` tables, and the same seed gives
other sequences now.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .readers import InteractionLog, RawId

__all__ = ["SyntheticConfig", "make_synthetic", "synthetic_arrays"]

LENGTHS = ("lognormal", "geometric")


@dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of the synthetic generator (defaults train in about a minute on CPU).

    Attributes:
        num_users: number of users.
        num_items: number of items.
        num_clusters: number of item clusters (user tastes).
        branching: Markov successors per item.
        zipf_a: Zipf exponent of item popularity.
        p_follow: probability that the next item follows the Markov chain.
        p_cluster: probability that it is drawn from the user's cluster instead.
        min_len: shortest sequence.
        max_seq_len: longest sequence.
        seed: random seed; the same seed gives the same data.
        lengths: ``"lognormal"`` (``min_len + floor(lognormal(1.5, 1))``, mean
            about ``min_len + 7``) or ``"geometric"`` (mean ``mean_len``).
        mean_len: mean length of ``lengths="geometric"`` before the cap.
    """

    num_users: int = 2000
    num_items: int = 500
    num_clusters: int = 20
    branching: int = 3
    zipf_a: float = 1.0
    p_follow: float = 0.6
    p_cluster: float = 0.25
    min_len: int = 3
    max_seq_len: int = 200
    seed: int = 0
    lengths: str = "lognormal"
    mean_len: float = 10.0

    def __post_init__(self) -> None:
        if self.num_items < self.num_clusters * (self.branching + 1):
            raise ValueError("need num_items >= num_clusters * (branching + 1)")
        if not (0 <= self.p_follow and 0 <= self.p_cluster and self.p_follow + self.p_cluster <= 1):
            raise ValueError("need p_follow, p_cluster >= 0 and p_follow + p_cluster <= 1")
        if not (1 <= self.min_len <= self.max_seq_len) or self.num_users < 1:
            raise ValueError("need num_users >= 1 and 1 <= min_len <= max_seq_len")
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {LENGTHS}, got {self.lengths!r}")
        if self.lengths == "geometric" and not self.mean_len >= self.min_len:
            raise ValueError(f"need mean_len >= min_len, got {self.mean_len} < {self.min_len}")


def _sample_rows(cum: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row of ``cum`` (row-wise cumulative probabilities; few columns)."""
    u = rng.random(len(cum)) * cum[:, -1]
    return np.minimum((cum <= u[:, None]).sum(1), cum.shape[1] - 1)


class _Popularity:
    """Zipf popularity sampling, globally or inside a cluster, in ``O(log N)`` a draw.

    Items are laid out cluster by cluster (by popularity inside each) with one
    cumulative weight array; a draw in cluster ``c`` is a binary search of a
    uniform number between the cluster's first and last cumulative weight.
    """

    def __init__(self, cfg: SyntheticConfig, rng: np.random.Generator) -> None:
        n = cfg.num_items
        self.pop = np.arange(1, n + 1, dtype=np.float64) ** -cfg.zipf_a
        self.cluster = rng.permutation(np.arange(n) % cfg.num_clusters)
        self.order = np.argsort(self.cluster, kind="stable")  # item ids, cluster by cluster
        self.start = np.searchsorted(self.cluster[self.order], np.arange(cfg.num_clusters))
        self.end = np.append(self.start[1:], n)
        cdf = np.cumsum(self.pop[self.order])
        self.cdf, self.low = cdf, np.concatenate([[0.0], cdf])[self.start]
        self.high = cdf[self.end - 1]
        self.global_cdf = np.cumsum(self.pop)

    def in_cluster(self, clusters: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One 0-based item per entry of ``clusters``, by popularity inside it."""
        low, high = self.low[clusters], self.high[clusters]
        at = np.searchsorted(self.cdf, low + rng.random(len(clusters)) * (high - low), "right")
        return self.order[np.clip(at, self.start[clusters], self.end[clusters] - 1)]

    def anywhere(self, size: int, rng: np.random.Generator) -> np.ndarray:
        """``size`` 0-based items by global popularity."""
        u = rng.random(size) * self.global_cdf[-1]
        return np.minimum(np.searchsorted(self.global_cdf, u, "right"), len(self.pop) - 1)


def _successors(
    cfg: SyntheticConfig, pop: _Popularity, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(N, b)`` distinct successors of each item in its own cluster (drawn by
    popularity, never the item itself) and their cumulative transition probabilities.

    Draws all ``N x b`` at once and redraws the entries that repeat an earlier one
    of their row or the item itself; rows still bad after a few rounds (a cluster
    dominated by one item) are drawn one by one without replacement.
    """
    n, b = cfg.num_items, cfg.branching
    own = np.repeat(pop.cluster, b)
    succ = pop.in_cluster(own, rng).reshape(n, b)
    items = np.arange(n)
    for _ in range(20):
        bad = succ == items[:, None]
        for j in range(1, b):
            bad[:, j] |= (succ[:, :j] == succ[:, j : j + 1]).any(1)
        rows, cols = np.nonzero(bad)
        if len(rows) == 0:
            break
        succ[rows, cols] = pop.in_cluster(pop.cluster[rows], rng)
    else:
        for i in np.unique(rows):
            c = pop.cluster[i]
            members = pop.order[pop.start[c] : pop.end[c]]
            members = members[members != i]
            p = pop.pop[members] / pop.pop[members].sum()
            succ[i] = rng.choice(members, size=b, replace=False, p=p)
    probs = rng.dirichlet(np.ones(b), size=n)
    return succ, np.cumsum(probs, axis=1)


def _lengths(cfg: SyntheticConfig, rng: np.random.Generator) -> np.ndarray:
    """History lengths, ``min_len`` plus a lognormal or geometric tail, capped."""
    if cfg.lengths == "geometric":
        extra = rng.geometric(1.0 / (cfg.mean_len - cfg.min_len + 1), size=cfg.num_users) - 1
    else:
        extra = np.floor(rng.lognormal(mean=1.5, sigma=1.0, size=cfg.num_users))
    return np.minimum(cfg.min_len + extra.astype(np.int64), cfg.max_seq_len)


def _walks(cfg: SyntheticConfig, offsets: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """All users' 0-based item walks, flat (user ``u`` at ``offsets[u]:offsets[u + 1]``).

    Step ``t`` draws one item for each user whose history is longer than ``t``:
    ``O(total interactions x (branching + log num_items))`` work.
    """
    pop = _Popularity(cfg, rng)
    succ, succ_cdf = _successors(cfg, pop, rng)
    lengths = np.diff(offsets)
    taste = rng.integers(cfg.num_clusters, size=cfg.num_users)
    by_length = np.argsort(-lengths, kind="stable")  # the users still walking: a prefix
    walking = np.searchsorted(-lengths[by_length], -1 - np.arange(int(lengths.max())), "right")
    items = np.empty(int(offsets[-1]), dtype=np.int64)
    cur = pop.in_cluster(taste[by_length], rng)
    items[offsets[by_length]] = cur
    for t in range(1, len(walking)):
        users, cur = by_length[: walking[t]], cur[: walking[t]]
        k = len(users)
        follow = succ[cur, _sample_rows(succ_cdf[cur], rng)]
        in_cluster = pop.in_cluster(taste[users], rng)
        anywhere = pop.anywhere(k, rng)
        mode = rng.random(k)
        cur = np.where(
            mode < cfg.p_follow,
            follow,
            np.where(mode < cfg.p_follow + cfg.p_cluster, in_cluster, anywhere),
        )
        items[offsets[users] + t] = cur
    return items


def synthetic_arrays(cfg: SyntheticConfig | None = None) -> tuple[np.ndarray, ...]:
    """The synthetic log as flat arrays: ``items`` (1-based raw ids, 1 = most
    popular), ``offsets`` ``(U + 1,)`` (user ``u`` holds ``items[offsets[u]:offsets[u+1]]``)
    and ``times``, each int64. Time and memory linear in users, items and interactions."""
    cfg = cfg or SyntheticConfig()
    rng = np.random.default_rng(cfg.seed)
    lengths = _lengths(cfg, rng)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    items = _walks(cfg, offsets, rng) + 1
    gaps = 1 + np.floor(rng.exponential(86_400.0, size=len(items))).astype(np.int64)
    start = 1_577_836_800 + rng.integers(0, 365 * 86_400, size=cfg.num_users)
    steps = np.cumsum(gaps)
    before = np.concatenate([[0], steps])[offsets[:-1]]  # the gaps of earlier users
    times = np.repeat(start - before, lengths) + steps
    return items, offsets, times


def make_synthetic(cfg: SyntheticConfig | None = None) -> InteractionLog:
    """Generate the synthetic log: users ``1..U``, raw items ``1..N`` (1 = most popular)."""
    cfg = cfg or SyntheticConfig()
    items, offsets, times = synthetic_arrays(cfg)
    flat, stamps = items.tolist(), times.tolist()
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
    users: list[RawId] = list(range(1, cfg.num_users + 1))
    seqs: list[list[RawId]] = [flat[a:b] for a, b in bounds]
    return InteractionLog(
        users, seqs, [stamps[a:b] for a, b in bounds], f"synthetic(seed={cfg.seed})"
    )
