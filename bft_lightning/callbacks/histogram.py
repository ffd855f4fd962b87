"""Fixed-bin histograms whose sums are exact under DDP.

A histogram here is one float64 row: ``bins`` counts followed by
``[n, sum, sum_of_squares, nonfinite]``; ``n`` and the moments cover the
finite values, ``nonfinite`` counts the NaN / infinite ones, which would
otherwise vanish and make a diverging model look healthy. Rows from several
batches or several processes add up elementwise, so the histogram of a
2-process run, summed across ranks, has exactly the counts one process would
compute over the same samples. The extremes (min, max) travel separately as
``[max, -min]``, reduced with ``max``.

Values outside ``[lo, hi]`` are clamped into the edge bins (so the counts sum
to ``n``); the true min and max are kept. Percentiles read from the counts are
bin-resolution estimates: for values inside the range they are within one
bin width, ``(hi - lo) / bins``, of the inverted-CDF quantile (the smallest
sample with at least q% of the samples at or below it); an interpolating
quantile of sparse samples (two values 0.8 apart: the median half-way) can
lie further off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

MOMENTS = 4  # n, sum, sum of squares, non-finite count, after the counts


@dataclass(frozen=True)
class Bins:
    """``n`` equal bins over ``[lo, hi]``."""

    lo: float
    hi: float
    n: int

    def __post_init__(self) -> None:
        if not self.hi > self.lo:
            raise ValueError(f"histogram range needs hi > lo, got [{self.lo}, {self.hi}]")
        if self.n < 1:
            raise ValueError(f"histogram needs at least one bin, got {self.n}")

    @property
    def width(self) -> float:
        return (self.hi - self.lo) / self.n

    def edges(self) -> Tensor:
        """The ``n + 1`` bin edges, float64."""
        return torch.linspace(self.lo, self.hi, self.n + 1, dtype=torch.float64)


def histogram_row(values: Tensor, bins: Bins) -> Tensor:
    """Counts and moments of the finite entries of ``values``, then how many were not
    finite: (bins.n + MOMENTS,) float64."""
    v = values.detach().flatten().float()
    finite = torch.isfinite(v)
    v = v[finite]
    vd = v.double()
    # the bin of each value against the float64 edges (values outside go to the edge
    # bins), counted by bincount: torch.histc bins in float32 (a value on an edge could
    # land one bin off) and raises on CUDA under torch.use_deterministic_algorithms
    index = ((vd - bins.lo) / bins.width).floor().clamp(0, bins.n - 1).long()
    counts = torch.bincount(index, minlength=bins.n)
    n, bad = float(v.numel()), float(finite.numel() - v.numel())
    moments = torch.stack([vd.new_tensor(n), vd.sum(), vd.square().sum(), vd.new_tensor(bad)])
    return torch.cat([counts.double(), moments])


def extremes_row(values: Tensor) -> Tensor:
    """``[max, -min]`` of the finite entries (``-inf`` when none), float64, for a max-reduce."""
    v = values.detach().flatten().double()
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return v.new_full((2,), -math.inf)
    return torch.stack([v.max(), -v.min()])


@dataclass
class Histogram:
    """A reduced histogram, ready for ``SummaryWriter.add_histogram_raw``.

    counts: (bins,) float64; limits: (bins,) right bin edges; ``num`` and the
    moments cover the finite values, ``nonfinite`` counts the others.
    """

    counts: Tensor
    limits: Tensor
    num: float
    sum: float
    sum_squares: float
    min: float
    max: float
    nonfinite: float = 0.0

    @classmethod
    def from_rows(cls, row: Tensor, extremes: Tensor, bins: Bins) -> Histogram:
        row, extremes = row.detach().cpu().double(), extremes.detach().cpu().double()
        n, s, ss, bad = (float(x) for x in row[bins.n :])
        return cls(
            counts=row[: bins.n],
            limits=bins.edges()[1:],
            num=n,
            sum=s,
            sum_squares=ss,
            min=-float(extremes[1]),
            max=float(extremes[0]),
            nonfinite=bad,
        )

    @property
    def mean(self) -> float:
        return self.sum / self.num if self.num > 0 else math.nan

    @property
    def std(self) -> float:
        if self.num <= 0:
            return math.nan
        return math.sqrt(max(self.sum_squares / self.num - self.mean**2, 0.0))


def percentile(counts: Tensor, bins: Bins, q: float) -> float:
    """The ``q``-th percentile (0..100) read from fixed-bin ``counts``, by linear interpolation.

    A bin-resolution estimate: within one bin width of the inverted-CDF quantile
    for samples inside ``[lo, hi]`` (see the module docstring). NaN for an
    empty histogram.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    c = counts.detach().cpu().double()
    total = float(c.sum())
    if total <= 0:
        return math.nan
    target = q / 100.0 * total
    cum = c.cumsum(0)
    i = min(int(torch.searchsorted(cum, cum.new_tensor([target]))), bins.n - 1)
    while c[i] == 0 and i < bins.n - 1:  # q = 0 lands on leading empty bins
        i += 1
    before = float(cum[i - 1]) if i > 0 else 0.0
    frac = (target - before) / float(c[i]) if c[i] > 0 else 0.0
    return bins.lo + (i + min(max(frac, 0.0), 1.0)) * bins.width
