"""Strata for ranking metrics: item-popularity quartiles and user history-length buckets.

Both use one rule, :func:`quartile_boundaries` + :func:`assign_quartile`:

* sort the population (real items ``1..num_items``, or evaluation users) by the
  value (training frequency, or history length), ascending;
* cut it into 4 groups of equal size ``M/4`` by position; the boundary ``b_j``
  (``j = 0, 1, 2``) is the value of the last member of group ``j``:
  ``b_j = v_sorted[ceil((j + 1) * M / 4) - 1]``;
* a member with value ``v`` goes to group ``q = #{j : b_j < v}``, i.e.
  ``q = 0`` if ``v <= b_0``, ``q = 1`` if ``b_0 < v <= b_1``, ... ``q = 3`` if
  ``v > b_2``.

So groups have exactly ``M/4`` members when values are distinct; values tied
at a boundary all go to the LOWER group (deterministic, independent of sort
order), which can leave a higher group small or empty on long-tailed data
(e.g. if more than half of the items were seen once, Q1 is empty). Q0 holds
the rarest items; user bucket B0 ("cold") the shortest histories.

Boundaries are computed once (items: from training frequencies; users: from
the history lengths of all evaluation users) and passed to
:class:`~bft_lightning.metrics.ranking.RankingMetric`, so every batch and
every DDP rank uses the same cut points.
"""

from __future__ import annotations

import torch
from torch import Tensor

NUM_STRATA = 4


def quartile_boundaries(values: Tensor) -> Tensor:
    """Return the 3 cut points ``b_0 <= b_1 <= b_2`` of ``values`` (M,), M >= 1.

    ``b_j = sort(values)[ceil((j + 1) M / 4) - 1]`` (the last member of group j).
    Same dtype as ``values`` (integer counts give integer cut points, which a
    ``module.half()`` does not round).
    """
    if values.ndim != 1 or values.numel() == 0:
        raise ValueError(f"values must be a non-empty 1D tensor, got shape {tuple(values.shape)}")
    m = values.numel()
    v_sorted = torch.sort(values).values  # (M,) keeps the dtype: integer counts stay exact
    last = [((j + 1) * m + NUM_STRATA - 1) // NUM_STRATA - 1 for j in range(NUM_STRATA - 1)]
    return v_sorted[torch.tensor(last, device=values.device)]  # (3,)


def assign_quartile(values: Tensor, boundaries: Tensor) -> Tensor:
    """Group of each value: ``q = #{j : b_j < v}`` in ``0..3`` (ties go to the lower group)."""
    b = boundaries.to(device=values.device, dtype=torch.float64).contiguous()
    return torch.searchsorted(b, values.double().contiguous(), right=False).long()


def popularity_quartiles(item_frequency: Tensor) -> Tensor:
    """Cut points of item popularity from training counts ``item_frequency`` (num_items + 1,).

    Index 0 is padding and is ignored; all real items, including ones never seen
    in training (frequency 0), take part.
    """
    if item_frequency.ndim != 1 or item_frequency.numel() < 2:
        raise ValueError("item_frequency must be 1D with padding at index 0 and >= 1 real item")
    return quartile_boundaries(item_frequency[1:])


def assign_item_stratum(target: Tensor, item_frequency: Tensor, boundaries: Tensor) -> Tensor:
    """Popularity quartile (0 = rarest .. 3) of each target item id, shape of ``target``."""
    freq = item_frequency.to(target.device)[target]
    return assign_quartile(freq, boundaries)


def history_buckets(history_len: Tensor) -> Tensor:
    """Cut points of history length over ALL evaluation users, ``history_len`` (U,)."""
    return quartile_boundaries(history_len)


def assign_user_bucket(history_len: Tensor, boundaries: Tensor) -> Tensor:
    """History-length bucket (0 = cold / shortest .. 3 = longest), shape of ``history_len``."""
    return assign_quartile(history_len, boundaries)
