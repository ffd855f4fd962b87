"""Fixed-bin histograms: counts, moments, extremes and percentile estimates."""

import math

import pytest
import torch

from bft_lightning.callbacks.histogram import (
    Bins,
    Histogram,
    extremes_row,
    histogram_row,
    percentile,
)


def test_counts_and_moments_match_the_samples():
    bins = Bins(0.0, 1.0, 10)
    x = torch.tensor([0.05, 0.15, 0.15, 0.95, 1.0, math.nan, math.inf, -math.inf])
    row = histogram_row(x, bins)
    assert row.dtype == torch.float64 and row.shape == (14,)
    assert row[:10].tolist() == [1, 2, 0, 0, 0, 0, 0, 0, 0, 2]
    finite = x[:5].double()
    assert row[10] == 5
    assert row[11].item() == pytest.approx(finite.sum().item())
    assert row[12].item() == pytest.approx(finite.square().sum().item())
    assert row[13] == 3  # NaN, +inf, -inf: counted, not dropped
    h = Histogram.from_rows(row + histogram_row(x[5:], bins), extremes_row(x), bins)
    assert (h.num, h.nonfinite, h.max) == (5, 6, 1.0) and h.min == pytest.approx(0.05)


def test_values_on_bin_edges_count_as_numpy_counts_them():
    """Interior edges open a bin (numpy's rule, the last bin closed) against the float64
    edges: torch.histc, in float32, put some edge values one bin off."""
    import numpy as np

    bins = Bins(-10.0, 10.0, 41)
    edges = bins.edges()
    x = torch.cat([edges, torch.linspace(-9.99, 9.99, 997, dtype=torch.float64)])
    got = histogram_row(x.float(), bins)[: bins.n]
    # the float32 copy of a value can cross an edge: compare with numpy on those copies
    expected, _ = np.histogram(x.float().double().numpy(), edges.numpy())
    assert got.tolist() == expected.tolist()


def test_out_of_range_values_land_in_the_edge_bins_and_extremes_stay_true():
    bins = Bins(0.0, 1.0, 4)
    x = torch.tensor([-3.0, 0.5, 7.0])
    h = Histogram.from_rows(histogram_row(x, bins), extremes_row(x), bins)
    assert h.counts.tolist() == [1, 0, 1, 1]
    assert (h.min, h.max, h.num) == (-3.0, 7.0, 3)
    assert h.limits.tolist() == [0.25, 0.5, 0.75, 1.0]


def test_rows_of_parts_add_up_to_the_row_of_the_whole():
    bins = Bins(-2.0, 2.0, 32)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    whole = histogram_row(x, bins)
    parts = histogram_row(x[:300], bins) + histogram_row(x[300:], bins)
    assert torch.equal(whole[:32], parts[:32])
    assert torch.allclose(whole, parts)
    ext = torch.maximum(extremes_row(x[:300]), extremes_row(x[300:]))
    assert torch.equal(ext, extremes_row(x))


def test_percentiles_are_within_one_bin_of_the_exact_quantiles():
    bins = Bins(0.0, 1.0, 100)
    x = torch.rand(5000, generator=torch.Generator().manual_seed(1)) ** 2
    counts = histogram_row(x, bins)[:100]
    for q in (10, 50, 90):
        exact = torch.quantile(x, q / 100).item()
        assert abs(percentile(counts, bins, q) - exact) <= bins.width


def test_empty_histogram_gives_nan_and_empty_extremes():
    bins = Bins(0.0, 1.0, 5)
    row = histogram_row(torch.empty(0), bins)
    assert row.sum() == 0
    assert math.isnan(percentile(row[:5], bins, 50))
    assert torch.isinf(extremes_row(torch.empty(0))).all()
    h = Histogram.from_rows(row, extremes_row(torch.empty(0)), bins)
    assert math.isnan(h.mean)


def test_bad_bins_are_rejected():
    with pytest.raises(ValueError):
        Bins(1.0, 1.0, 3)
    with pytest.raises(ValueError):
        Bins(0.0, 1.0, 0)
