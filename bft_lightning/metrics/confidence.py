"""How well a per-user confidence predicts a hit: AUROC and hit rate by decile.

``auroc`` is the Mann-Whitney statistic: the probability that a random hit
gets a higher confidence than a random miss, ties counted one half (average
ranks), so a constant confidence scores exactly 0.5.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _average_ranks(x: Tensor) -> Tensor:
    """1-based ranks of ``x`` (1-D), tied values sharing their mean rank (float64)."""
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    _, inverse, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # last 1-based rank of each tie block
    mean_rank = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(mean_rank[inverse])
    ranks[order] = mean_rank[inverse]
    return ranks


def auroc(confidence: Tensor, hit: Tensor) -> float:
    """Area under the ROC curve of ``confidence`` (N,) for the binary ``hit`` (N,).

    Ties count one half. NaN confidences are an error; with no hit or no miss
    the AUROC is undefined and NaN is returned.
    """
    conf = torch.as_tensor(confidence).detach().double().flatten().cpu()
    pos = torch.as_tensor(hit).detach().flatten().cpu().bool()
    if conf.shape != pos.shape:
        raise ValueError(f"confidence has {conf.numel()} values, hit {pos.numel()}")
    if bool(torch.isnan(conf).any()):
        raise ValueError("confidence holds NaN values")
    n_pos = int(pos.sum())
    n_neg = int(pos.numel()) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _average_ranks(conf)
    u = float(ranks[pos].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def hit_rate_by_decile(confidence: Tensor, hit: Tensor, bins: int = 10) -> list[float]:
    """Hit rate in each of ``bins`` equal-count groups of users, lowest confidence first.

    Users are sorted by confidence (ties in a random but fixed order would
    split a tie block across bins; here ties are broken by position, stably)
    and cut into ``bins`` groups of sizes differing by at most one.
    """
    conf = torch.as_tensor(confidence).detach().double().flatten().cpu()
    hits = torch.as_tensor(hit).detach().flatten().cpu().double()
    if conf.shape != hits.shape:
        raise ValueError(f"confidence has {conf.numel()} values, hit {hits.numel()}")
    if conf.numel() < bins:
        raise ValueError(f"{conf.numel()} users cannot fill {bins} bins")
    order = torch.argsort(conf, stable=True)
    return [float(part.mean()) for part in torch.tensor_split(hits[order], bins)]
