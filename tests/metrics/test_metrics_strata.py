"""Quartile strata: equal groups on distinct values, ties to the lower group, padding ignored."""

import torch

from bft_lightning.metrics.strata import (
    assign_item_stratum,
    assign_quartile,
    assign_user_bucket,
    history_buckets,
    popularity_quartiles,
    quartile_boundaries,
)


def test_distinct_values_split_in_four_equal_groups():
    values = torch.randperm(100)
    groups = assign_quartile(values, quartile_boundaries(values))
    assert torch.bincount(groups, minlength=4).tolist() == [25, 25, 25, 25]
    # Q0 holds exactly the 25 smallest values
    assert set(values[groups == 0].tolist()) == set(range(25))


def test_boundary_ties_go_to_the_lower_group():
    values = torch.tensor([1, 1, 1, 1, 1, 2, 3, 4])
    b = quartile_boundaries(values)
    assert b.tolist() == [1.0, 1.0, 2.0]
    assert assign_quartile(values, b).tolist() == [0, 0, 0, 0, 0, 2, 3, 3]
    # order of the input does not matter
    perm = torch.randperm(8)
    assert assign_quartile(values[perm], quartile_boundaries(values[perm])).tolist() == (
        assign_quartile(values, b)[perm].tolist()
    )


def test_popularity_ignores_padding_and_maps_targets():
    freq = torch.tensor([10_000, 1, 2, 3, 4, 5, 6, 7, 8])  # index 0 = padding
    b = popularity_quartiles(freq)
    assert b.tolist() == [2.0, 4.0, 6.0]
    target = torch.arange(1, 9)
    assert assign_item_stratum(target, freq, b).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_user_buckets_cold_is_shortest():
    hist = torch.tensor([50, 3, 7, 20, 1, 9, 30, 2])
    bucket = assign_user_bucket(hist, history_buckets(hist))
    assert bucket[hist.argsort()].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert bucket[hist == 1].item() == 0 and bucket[hist == 50].item() == 3
