"""The built-in synthetic dataset: seeded, Zipf-like, learnable beyond popularity."""

from __future__ import annotations

import numpy as np
import pytest

from bft_lightning.datamodules.splits import encode, eval_arrays, leave_one_out
from bft_lightning.datamodules.synthetic import SyntheticConfig, make_synthetic


@pytest.fixture(scope="module")
def default_log():
    return make_synthetic()


def test_deterministic_per_seed(default_log):
    again = make_synthetic(SyntheticConfig(seed=0))
    assert again.sequences == default_log.sequences and again.timestamps == default_log.timestamps
    other = make_synthetic(SyntheticConfig(seed=1))
    assert other.sequences != default_log.sequences


def test_shape_lengths_and_time(default_log):
    lengths = np.array([len(s) for s in default_log.sequences])
    assert default_log.num_users == 2000 and 450 <= default_log.num_items <= 500
    assert lengths.min() >= 3 and lengths.max() <= 200
    assert np.median(lengths) < lengths.mean()  # right-skewed: many short histories
    assert (lengths <= 5).mean() > 0.2
    assert all(np.all(np.diff(t) >= 1) for t in default_log.timestamps)
    assert all(1.5e9 < t[0] < 2e9 for t in default_log.timestamps)


def test_zipf_like_popularity(default_log):
    counts = np.sort(np.bincount([i for s in default_log.sequences for i in s]))[::-1]
    top = counts[:100]
    slope = np.polyfit(np.log(np.arange(1, 101)), np.log(top), 1)[0]
    assert -2.0 < slope < -0.4  # power-law decay of the head
    assert counts[: len(counts) // 10].sum() > 0.35 * counts.sum()


def _hit_rate_at_10(scores: np.ndarray, target: np.ndarray) -> float:
    """HR@10, ties counted against the target (pessimistic), padding id 0 excluded."""
    scores = scores.astype(np.float64).copy()
    scores[:, 0] = -np.inf
    mine = scores[np.arange(len(target)), target]
    rank = (scores > mine[:, None]).sum(1) + (scores == mine[:, None]).sum(1) - 1
    return float((rank < 10).mean())


def test_bigram_beats_popularity(default_log):
    data = encode(default_log)
    split = leave_one_out(data)
    bigram = np.zeros((data.num_items + 1, data.num_items + 1))
    for s, e in zip(split.train_start, split.train_end):
        train = data.items[s:e]
        np.add.at(bigram, (train[:-1], train[1:]), 1.0)
    test = eval_arrays(data, split, 50, "test")
    pop = split.item_frequency.astype(np.float64)
    pop_scores = np.broadcast_to(pop, (len(test["target"]), len(pop)))
    bigram_scores = bigram[test["input_ids"][:, -1]] + 1e-3 * pop  # popularity breaks ties
    hr_pop = _hit_rate_at_10(pop_scores, test["target"])
    hr_bigram = _hit_rate_at_10(bigram_scores, test["target"])
    assert hr_bigram > 2 * hr_pop and hr_bigram > hr_pop + 0.25, (hr_bigram, hr_pop)


def test_config_is_checked():
    with pytest.raises(ValueError):
        SyntheticConfig(num_items=10, num_clusters=5)
    with pytest.raises(ValueError):
        SyntheticConfig(p_follow=0.8, p_cluster=0.3)
