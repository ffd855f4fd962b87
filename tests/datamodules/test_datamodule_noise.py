"""datamodules/noise.py and SequenceDataModule(train_noise=...): noisy histories, clean targets."""

from __future__ import annotations

import numpy as np
import pytest

from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.datamodules.noise import corrupt_training_items, training_positions
from bft_lightning.datamodules.splits import SequenceData, leave_one_out


def _data(lengths, num_items=50, seed=0) -> SequenceData:
    rng = np.random.default_rng(seed)
    n = int(sum(lengths))
    return SequenceData(
        items=rng.integers(1, num_items + 1, n),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        times=None,
        num_items=num_items,
        user_ids=np.array([f"u{i}" for i in range(len(lengths))]),
        item_ids=np.array([""] + [f"i{i}" for i in range(num_items)]),
    )


def test_training_positions_are_those_of_the_split():
    data = _data([5, 2, 3, 1, 7])
    split = leave_one_out(data)
    expected = np.concatenate([np.arange(s, e) for s, e in zip(split.train_start, split.train_end)])
    assert np.array_equal(training_positions(data), expected)


@pytest.mark.parametrize("rate", [0.1, 0.3, 1.0])
def test_exactly_the_share_is_replaced_by_other_items_and_targets_stay_clean(rate):
    data = _data([int(n) for n in np.random.default_rng(1).integers(1, 30, 200)])
    noisy, mask = corrupt_training_items(data, rate, seed=3)
    eligible = training_positions(data)
    assert mask.sum() == round(rate * len(eligible))
    assert mask[np.setdiff1d(np.arange(len(mask)), eligible)].sum() == 0  # targets untouched
    changed = noisy.items != data.items
    assert np.array_equal(changed, mask)  # every replacement differs from the original
    assert noisy.items.min() >= 1 and noisy.items.max() <= data.num_items
    assert np.array_equal(noisy.offsets, data.offsets) and noisy.items is not data.items
    again, mask2 = corrupt_training_items(data, rate, seed=3)
    assert np.array_equal(again.items, noisy.items) and np.array_equal(mask, mask2)
    other, _ = corrupt_training_items(data, rate, seed=4)
    assert rate == 1.0 or not np.array_equal(other.items, noisy.items)


def test_replacements_are_uniform_over_the_other_items():
    data = _data([40] * 500, num_items=5)
    noisy, mask = corrupt_training_items(data, 1.0, seed=0)
    pairs = np.stack([data.items[mask], noisy.items[mask]])
    for item in range(1, 6):
        drawn = pairs[1][pairs[0] == item]
        counts = np.bincount(drawn, minlength=6)[1:]
        assert counts[item - 1] == 0
        others = np.delete(counts, item - 1)
        assert others.min() > 0.8 * others.mean()  # ~3,800 draws per item: 4 equal shares


def test_zero_rate_is_the_data_itself_and_bad_rates_are_refused():
    data = _data([4, 4])
    same, mask = corrupt_training_items(data, 0.0)
    assert same is data and not mask.any()
    with pytest.raises(ValueError, match="train_noise"):
        corrupt_training_items(data, 1.5)
    with pytest.raises(ValueError, match="train_noise must be a number in"):
        SequenceDataModule(train_noise=-0.1)


def test_datamodule_corrupts_training_rows_and_keeps_validation_and_test_targets():
    clean = SequenceDataModule(dataset="synthetic", synthetic_users=300, synthetic_items=80)
    noisy = SequenceDataModule(
        dataset="synthetic", synthetic_users=300, synthetic_items=80, train_noise=0.3
    )
    for dm in (clean, noisy):
        dm.setup("fit")
        dm.setup("test")
    assert noisy.noise_mask is not None
    eligible = training_positions(clean.sequences)
    assert noisy.noise_mask.sum() == round(0.3 * len(eligible))
    for name in ("val", "test"):
        a, b = clean._dataset(name), noisy._dataset(name)
        assert np.array_equal(np.asarray(a.arrays["target"]), np.asarray(b.arrays["target"]))
    # training targets are the corrupted items: the frequency counts follow them
    assert not np.array_equal(clean.split.item_frequency, noisy.split.item_frequency)
    assert clean.split.item_frequency.sum() == noisy.split.item_frequency.sum()
