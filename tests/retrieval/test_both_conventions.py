"""Both evaluation conventions from one pass over the scores: each equals its own run.

``ranks_both_ways`` counts the ranks with the user's history kept in and excluded
from the same tiles; each must equal ``target_ranks`` with ``exclude=None`` and
``exclude=history`` (the dense definition too), ties, duplicates, targets inside
their own history and padding included. The task then reports both, and the
unsuffixed keys follow ``mask_history``.
"""

import math

import lightning as L
import pytest
import torch
from test_retrieval import ITEMS, MODELS, _histories, _inputs, _model
from torch.utils.data import DataLoader

from bft_lightning import retrieval
from bft_lightning.metrics.ranking import RankingMetric
from bft_lightning.tasks import SequentialRecommendation


@pytest.mark.parametrize("backbone", ["sasrec", "hstu", "precision_head"])
@pytest.mark.parametrize("integer", [False, True])
def test_both_ways_equal_two_separate_rankings(backbone, integer):
    m = _model(backbone, integer=integer)
    hidden, lp, target, seen = _inputs(m, integer=integer)
    unmasked, masked = retrieval.ranks_both_ways(m, hidden, lp, target, seen)
    assert torch.equal(unmasked, retrieval.target_ranks(m, hidden, lp, target))
    assert torch.equal(masked, retrieval.target_ranks(m, hidden, lp, target, seen))
    assert bool((masked <= unmasked).all())  # excluding items never lowers a target
    assert bool((masked < unmasked).any())  # and here some seen item did outrank it


def test_both_ways_dense_fallback_agrees():
    """Non-finite factors send ranking to the dense path; its two conventions agree
    with the tiled ones on the same finite model."""
    m = _model("sasrec", integer=True)
    hidden, lp, target, seen = _inputs(m, integer=True)
    tiled = retrieval.ranks_both_ways(m, hidden, lp, target, seen)
    from bft_lightning.retrieval.dense import dense_target_ranks

    assert torch.equal(tiled[0], dense_target_ranks(m, hidden, lp, target, None))
    assert torch.equal(tiled[1], dense_target_ranks(m, hidden, lp, target, seen))


def test_metric_reports_the_other_convention_with_its_suffix():
    g = torch.Generator().manual_seed(0)
    ranks = torch.randint(0, 40, (12,), generator=g)
    other = (ranks - torch.randint(0, 5, (12,), generator=g)).clamp_min(0)
    target = torch.randint(1, 30, (12,), generator=g)
    m = RankingMetric(12, protocol="unmasked", ks=(10,))
    m.update(None, target, torch.arange(12), ranks=ranks, ranks_other=other)
    out = m.compute()
    assert out["hr@10"] == pytest.approx(float((ranks < 10).double().mean()))
    assert out["hr@10_seen_masked"] == pytest.approx(float((other < 10).double().mean()))
    assert "n_seen_masked" not in out
    flipped = RankingMetric(12, protocol="seen_masked", ks=(10,))
    flipped.update(None, target, torch.arange(12), ranks=other, ranks_other=ranks)
    got = flipped.compute()
    assert got["hr@10"] == out["hr@10_seen_masked"]
    assert got["hr@10_unmasked"] == out["hr@10"]
    assert set(m.ranks_by_protocol) == {"unmasked", "seen_masked"}
    with pytest.raises(ValueError, match="protocol"):
        RankingMetric(3, protocol="masked")


@pytest.mark.parametrize("mask_history", [False, True])
def test_task_logs_both_conventions(tmp_path, mask_history):
    torch.manual_seed(0)
    task = SequentialRecommendation(ITEMS, 20, backbone=MODELS["sasrec"], mask_history=mask_history)
    loader = DataLoader(_histories(200, ITEMS), batch_size=64)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    got = trainer.validate(task, dataloaders=loader, verbose=False)[0]
    runs = {}
    for mask in (False, True):
        ref = SequentialRecommendation(ITEMS, 20, backbone=MODELS["sasrec"], mask_history=mask)
        ref.load_state_dict(task.state_dict())
        runs[mask] = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                               enable_model_summary=False,
                               default_root_dir=tmp_path).validate(ref, dataloaders=loader,
                                                                   verbose=False)[0]  # fmt: skip
    suffix = "_unmasked" if mask_history else "_seen_masked"
    for key in ("hr@10", "ndcg@10", "mrr", "hr@1"):
        want, other = runs[mask_history][f"val/{key}"], runs[not mask_history][f"val/{key}"]
        assert got[f"val/{key}"] == pytest.approx(want, abs=1e-12)
        if math.isfinite(other):
            assert got[f"val/{key}{suffix}"] == pytest.approx(other, abs=1e-12)
