"""Ranks of a full score matrix and per-user HR/NDCG/MRR against brute force and torchmetrics."""

import math

import pytest
import torch
from torchmetrics.functional.retrieval import (
    retrieval_hit_rate,
    retrieval_normalized_dcg,
    retrieval_reciprocal_rank,
)

import bft_lightning.metrics.ranking as ranking
from bft_lightning.metrics.ranking import hr_ndcg_mrr, target_ranks

KS = (1, 5, 10, 20)


def brute_rank(scores, target, exclude=None):
    """Python loop: other real, non-excluded items scoring >= the target."""
    out = []
    for b in range(scores.shape[0]):
        t = int(target[b])
        r = 0
        for j in range(1, scores.shape[1]):
            if j == t or (exclude is not None and exclude[b, j]):
                continue
            r += int(scores[b, j] >= scores[b, t])
        out.append(r)
    return out


@pytest.mark.parametrize("with_exclude", [False, True])
def test_target_ranks_match_brute_force_with_ties(with_exclude):
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (12, 25), generator=g).float()  # many ties
    target = torch.randint(1, 25, (12,), generator=g)
    exclude = torch.rand(12, 25, generator=g) < 0.3 if with_exclude else None
    if exclude is not None:
        exclude[:3].scatter_(1, target[:3, None], True)  # target in the history: still ranked
    assert target_ranks(scores, target, exclude).tolist() == brute_rank(scores, target, exclude)


@pytest.mark.parametrize("block", [1, 3, 7, 4096])
def test_blocked_rank_count_matches_brute_force(monkeypatch, block):
    """The column-blocked count (no exclusion) at block sizes that cut rows anywhere,
    with ties, a padding column that would count and infinite scores."""
    monkeypatch.setattr(ranking, "RANK_BLOCK", block)
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (16, 23), generator=g).float()
    scores[::3, 0] = 10.0  # padding above every target: must not count
    scores[1, 5] = -math.inf
    scores[2, :] = math.inf
    target = torch.randint(1, 23, (16,), generator=g)
    target[1] = 5  # a target at -inf: every other real item counts
    assert target_ranks(scores, target).tolist() == brute_rank(scores, target)


def test_exclusion_only_lowers_ranks():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(16, 40, generator=g)
    target = torch.randint(1, 40, (16,), generator=g)
    exclude = torch.rand(16, 40, generator=g) < 0.5
    assert (target_ranks(scores, target, exclude) <= target_ranks(scores, target)).all()


def test_all_equal_scores_are_pessimistic():
    scores = torch.zeros(5, 31)
    target = torch.tensor([1, 2, 10, 29, 30])
    ranks = target_ranks(scores, target)
    assert ranks.tolist() == [29] * 5  # N - 2: every other real item counts above
    per_user = hr_ndcg_mrr(ranks, KS)
    for k in KS:
        assert per_user[f"hr@{k}"].sum() == 0 and per_user[f"ndcg@{k}"].sum() == 0


def test_padding_column_never_counts():
    scores = torch.tensor([[100.0, 1.0, 2.0, 3.0], [float("inf"), 3.0, 2.0, 1.0]])
    assert target_ranks(scores, torch.tensor([3, 1])).tolist() == [0, 0]
    # a target scored -inf ties with nothing but real items; padding still not counted
    scores = torch.tensor([[-math.inf, -math.inf, 0.0, -math.inf]])
    assert target_ranks(scores, torch.tensor([1])).tolist() == [2]


def test_invalid_inputs_raise():
    scores = torch.randn(2, 5)
    with pytest.raises(ValueError, match="NaN"):
        target_ranks(torch.tensor([[0.0, float("nan"), 1.0]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="padding"):
        target_ranks(scores, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="padding"):
        target_ranks(scores, torch.tensor([5, 1]))


def test_formulas_against_brute_force():
    ranks = torch.tensor([0, 1, 4, 5, 9, 10, 19, 20, 500])
    per_user = hr_ndcg_mrr(ranks, KS)
    for i, r in enumerate(ranks.tolist()):
        for k in KS:
            assert per_user[f"hr@{k}"][i] == float(r < k)
            expect = 1.0 / math.log2(r + 2) if r < k else 0.0
            assert per_user[f"ndcg@{k}"][i].item() == pytest.approx(expect, abs=1e-15)
        assert per_user["mrr"][i].item() == pytest.approx(1.0 / (r + 1), abs=1e-15)


def test_against_torchmetrics_on_positive_scores():
    """torchmetrics drops scores <= 0 and averages 2D NDCG: compare 1D, positive, tie-free."""
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(16, 60, generator=g) + 0.01  # (B, N), positive
    target = torch.randint(1, 60, (16,), generator=g)
    per_user = hr_ndcg_mrr(target_ranks(scores, target), KS)
    for b in range(16):
        preds = scores[b, 1:]  # real items only
        rel = torch.zeros_like(preds, dtype=torch.bool)
        rel[target[b] - 1] = True
        for k in KS:
            assert per_user[f"hr@{k}"][b].item() == retrieval_hit_rate(preds, rel, top_k=k)
            tm = retrieval_normalized_dcg(preds, rel, top_k=k).item()
            assert per_user[f"ndcg@{k}"][b].item() == pytest.approx(tm, abs=1e-6)
        tm_rr = retrieval_reciprocal_rank(preds, rel).item()
        assert per_user["mrr"][b].item() == pytest.approx(tm_rr, abs=1e-6)
