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
- Lengths are ``min_len + floor(lognormal)``, capped at ``max_seq_len``:
  many short histories and a long tail.
- Timestamps start in 2020 and increase by at least one second per step
  (exponential gaps with a one-day mean), so time-aware models can use them.

The Markov structure makes the data learnable: a bigram recommender beats
popularity by a wide margin (see ``tests/datamodules/test_synthetic.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .readers import InteractionLog, RawId

__all__ = ["SyntheticConfig", "make_synthetic"]


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

    def __post_init__(self) -> None:
        if self.num_items < self.num_clusters * (self.branching + 1):
            raise ValueError("need num_items >= num_clusters * (branching + 1)")
        if not (0 <= self.p_follow and 0 <= self.p_cluster and self.p_follow + self.p_cluster <= 1):
            raise ValueError("need p_follow, p_cluster >= 0 and p_follow + p_cluster <= 1")
        if not (1 <= self.min_len <= self.max_seq_len) or self.num_users < 1:
            raise ValueError("need num_users >= 1 and 1 <= min_len <= max_seq_len")


def _sample_rows(cum: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row of ``cum`` (row-wise cumulative probabilities)."""
    u = rng.random(len(cum)) * cum[:, -1]
    return np.minimum((cum <= u[:, None]).sum(1), cum.shape[1] - 1)


def _clusters(
    cfg: SyntheticConfig, pop: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Item clusters (every cluster non-empty) and per-cluster popularity CDFs."""
    cluster = rng.permutation(np.arange(cfg.num_items) % cfg.num_clusters)
    weights = np.where(cluster[None, :] == np.arange(cfg.num_clusters)[:, None], pop, 0.0)
    return cluster, np.cumsum(weights, axis=1)  # (N,), (C, N)


def _successors(
    cfg: SyntheticConfig, pop: np.ndarray, cluster: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(N, b)`` successor items and their cumulative transition probabilities."""
    succ = np.zeros((cfg.num_items, cfg.branching), dtype=np.int64)
    for i in range(cfg.num_items):
        members = np.flatnonzero((cluster == cluster[i]) & (np.arange(cfg.num_items) != i))
        p = pop[members] / pop[members].sum()
        succ[i] = rng.choice(members, size=cfg.branching, replace=False, p=p)
    probs = rng.dirichlet(np.ones(cfg.branching), size=cfg.num_items)
    return succ, np.cumsum(probs, axis=1)


def _walks(cfg: SyntheticConfig, lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``(U, max(lengths))`` 0-based item walks (entries past a user's length unused)."""
    pop = np.arange(1, cfg.num_items + 1, dtype=np.float64) ** -cfg.zipf_a
    cluster, cluster_cdf = _clusters(cfg, pop, rng)
    succ, succ_cdf = _successors(cfg, pop, cluster, rng)
    taste = rng.integers(cfg.num_clusters, size=cfg.num_users)
    walks = np.zeros((cfg.num_users, int(lengths.max())), dtype=np.int64)
    walks[:, 0] = _sample_rows(cluster_cdf[taste], rng)
    for t in range(1, walks.shape[1]):
        cur = walks[:, t - 1]
        follow = succ[cur, _sample_rows(succ_cdf[cur], rng)]
        in_cluster = _sample_rows(cluster_cdf[taste], rng)
        anywhere = rng.choice(cfg.num_items, size=cfg.num_users, p=pop / pop.sum())
        mode = rng.random(cfg.num_users)
        walks[:, t] = np.where(
            mode < cfg.p_follow,
            follow,
            np.where(mode < cfg.p_follow + cfg.p_cluster, in_cluster, anywhere),
        )
    return walks


def make_synthetic(cfg: SyntheticConfig | None = None) -> InteractionLog:
    """Generate the synthetic log: users ``1..U``, raw items ``1..N`` (1 = most popular)."""
    cfg = cfg or SyntheticConfig()
    rng = np.random.default_rng(cfg.seed)
    extra = np.floor(rng.lognormal(mean=1.5, sigma=1.0, size=cfg.num_users)).astype(np.int64)
    lengths = np.minimum(cfg.min_len + extra, cfg.max_seq_len)
    walks = _walks(cfg, lengths, rng) + 1
    gaps = 1 + np.floor(rng.exponential(86_400.0, size=walks.shape)).astype(np.int64)
    start = 1_577_836_800 + rng.integers(0, 365 * 86_400, size=(cfg.num_users, 1))
    times = start + np.cumsum(gaps, axis=1)
    users: list[RawId] = list(range(1, cfg.num_users + 1))
    seqs: list[list[RawId]] = [walks[u, :n].tolist() for u, n in enumerate(lengths)]
    stamps = [times[u, :n].tolist() for u, n in enumerate(lengths)]
    return InteractionLog(users, seqs, stamps, f"synthetic(seed={cfg.seed})")
