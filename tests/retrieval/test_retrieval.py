"""retrieval.topk / target_ranks on real backbones against the dense score matrix."""

import math
from functools import partial

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from bft_lightning import retrieval
from bft_lightning.metrics.ranking import RankingMetric
from bft_lightning.metrics.ranking import target_ranks as full_ranks
from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.tasks import SequentialRecommendation

ITEMS = 5000

MODELS = {
    "sasrec": partial(SASRec, d_model=16),
    "bert4rec": partial(BERT4Rec, d_model=16),
    "hstu": partial(HSTU, d_model=16),
    "precision_head": partial(SASRec, d_model=16, precision="on", head="precision"),
}


def _model(name, integer=False, seed=0):
    torch.manual_seed(seed)
    m = MODELS[name](ITEMS, 20).eval()
    with torch.no_grad():
        if hasattr(m, "out_bias"):
            m.out_bias.normal_()
        if hasattr(m, "temperature"):
            m.temperature.weight.normal_(std=0.3)
        if integer:  # exact products in any order, and many exact ties
            m.item_emb.weight.copy_(torch.randint(-2, 3, m.item_emb.weight.shape).float())
            if hasattr(m, "out_bias"):
                m.out_bias.copy_(torch.randint(-1, 2, m.out_bias.shape).float())
    return m


def _inputs(m, users=300, seed=1, integer=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(users, 16, generator=g)
    if integer:
        hidden = torch.randint(-2, 3, (users, 16), generator=g).float()
        if isinstance(m, BERT4Rec):  # its head transform would make them inexact
            m.transform = torch.nn.Identity()
    lp = torch.randn(users, m.groups, generator=g) if m.head == "precision" else None
    target = torch.randint(1, ITEMS + 1, (users,), generator=g)
    exclude = torch.randint(0, ITEMS + 1, (users, 50), generator=g)
    exclude[:20, 0] = target[:20]  # targets in their own exclusion list
    exclude[:, 1] = exclude[:, 2]  # duplicates
    exclude[:, -5:] = 0  # padding
    return hidden, lp, target, exclude


def _dense(m, hidden, lp, exclude):
    """Today's evaluation: the full score matrix in the weights' dtype and a dense mask."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        scores = m.score(hidden.to(m.item_emb.weight.dtype), lp).float()
    mask = None
    if exclude is not None:
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, exclude, True)
    return scores, mask


def _check_topk(top, scores, mask, k):
    """Values equal the masked full top-k exactly; ids distinct, eligible, pointing at
    them (which of tied items is returned may differ); logsumexp to float32 rounding."""
    masked = scores if mask is None else scores.masked_fill(mask, -math.inf)
    assert top.scores.dtype == torch.float32 and top.ids.dtype == torch.long
    assert torch.equal(top.scores, masked.topk(k, dim=1).values)
    assert torch.equal(masked.gather(1, top.ids), top.scores)
    assert all(len(set(r.tolist())) == k for r in top.ids) and (top.ids > 0).all()
    want = torch.logsumexp(masked.double(), dim=1)
    torch.testing.assert_close(top.logsumexp.double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("excluded", [False, True])
def test_ranks_and_topk_equal_the_dense_path(name, integer, excluded):
    m = _model(name, integer)
    hidden, lp, target, exclude = _inputs(m, integer=integer)
    exclude = exclude if excluded else None
    scores, mask = _dense(m, hidden, lp, exclude)
    ranks = retrieval.target_ranks(m, hidden, lp, target, exclude)
    assert torch.equal(ranks, full_ranks(scores, target, mask))
    _check_topk(retrieval.topk(m, hidden, lp, 10, exclude), scores, mask, 10)
    if integer:  # ties everywhere: still the same ranks
        assert (scores[:, 1:, None] == scores[:, None, 1:2]).sum() > 1000


def test_k_past_the_eligible_items_is_padded_and_bad_k_refused():
    torch.manual_seed(0)
    m = SASRec(6, 5, d_model=8).eval()
    hidden = torch.randn(3, 8)
    exclude = torch.tensor([[1, 2, 0], [0, 0, 0], [1, 2, 3]])
    top = retrieval.topk(m, hidden, None, 8, exclude)
    assert top.ids.shape == top.scores.shape == (3, 8)
    assert (top.ids[:, 6:] == 0).all() and (top.scores[:, 6:] == -math.inf).all()
    assert (top.ids[0, 4:] == 0).all() and (top.ids[0, :4] > 0).all()
    assert (top.ids[2, 3:] == 0).all() and (top.ids[1, :6] > 0).all()
    assert set(top.ids[1, :6].tolist()) == set(range(1, 7))
    scores, mask = _dense(m, hidden, None, exclude)
    want = torch.logsumexp(scores.masked_fill(mask, -math.inf), 1)
    torch.testing.assert_close(top.logsumexp, want)
    for k in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="k must be"):
            retrieval.topk(m, hidden, None, k)  # type: ignore[arg-type]


def test_bad_input_is_refused_with_a_clear_message():
    m = _model("sasrec")
    hidden, _, target, exclude = _inputs(m, users=4)
    bad = hidden.clone()
    bad[1, 3] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        retrieval.target_ranks(m, bad, None, target)
    with pytest.raises(ValueError, match="NaN"):
        retrieval.topk(m, bad, None, 3)
    with pytest.raises(ValueError, match="target ids"):
        retrieval.target_ranks(m, hidden, None, target * 0)
    with pytest.raises(ValueError, match="exclude ids"):
        retrieval.topk(m, hidden, None, 3, exclude + ITEMS)
    with pytest.raises(ValueError, match="exclude must be"):
        retrieval.topk(m, hidden, None, 3, exclude[:2])
    huge = hidden * 1e37  # finite, but the product may overflow: the dense path
    scores, _ = _dense(m, huge, None, None)
    assert torch.equal(retrieval.target_ranks(m, huge, None, target), full_ranks(scores, target))


def test_scores_in_the_weights_dtype_under_autocast():
    """Under bf16 autocast the ranks are those of the float32 scores (a bf16 score matrix
    ties many items with the target); a bf16 model ranks its own bf16 scores."""
    m = _model("sasrec")
    hidden, _, target, exclude = _inputs(m)
    scores, mask = _dense(m, hidden, None, exclude)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ranks = retrieval.target_ranks(m, hidden, None, target, exclude)
        top = retrieval.topk(m, hidden, None, 5, exclude)
    assert torch.equal(ranks, full_ranks(scores, target, mask))
    _check_topk(top, scores, mask, 5)
    m16 = m.to(torch.bfloat16)
    scores16, _ = _dense(m16, hidden, None, None)
    assert torch.equal(
        retrieval.target_ranks(m16, hidden, None, target), full_ranks(scores16, target)
    )


def _histories(users, items, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, items + 1, (users, 20), generator=g)
    ids[: users // 2, :7] = 0  # left padding
    return [
        {"input_ids": ids[u], "target": torch.randint(1, items + 1, (), generator=g),
         "user": torch.tensor(u), "history_len": (ids[u] > 0).sum()}
        for u in range(users)
    ]  # fmt: skip


@pytest.mark.parametrize("backbone", ["sasrec", "bert4rec", "precision_head"])
@pytest.mark.parametrize("mask_history", [False, True])
def test_task_validation_equals_the_dense_path(tmp_path, backbone, mask_history):
    """The task's validation metrics (ranks from tiles) equal those of today's path: the
    full score matrix, a dense mask of the history, RankingMetric on the scores."""
    torch.manual_seed(0)
    task = SequentialRecommendation(ITEMS, 20, backbone=MODELS[backbone], mask_history=mask_history)
    loader = DataLoader(_histories(300, ITEMS), batch_size=64)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    got = trainer.validate(task, dataloaders=loader, verbose=False)[0]
    ref = RankingMetric(300)
    task.eval()
    with torch.no_grad():
        for batch in loader:
            hidden, lp = task.model.last_hidden(batch["input_ids"])
            scores, mask = _dense(
                task.model, hidden, lp, batch["input_ids"] if mask_history else None
            )
            ref.update(scores, batch["target"], batch["user"], batch["history_len"], exclude=mask)
    want = ref.compute()
    for key, value in want.items():
        if math.isfinite(value) and f"val/{key}" in got:
            assert got[f"val/{key}"] == pytest.approx(value, rel=1e-6, abs=0), key
    assert torch.equal(task.val_metric.rank, ref.rank)  # type: ignore[union-attr]


def test_ranking_metric_takes_ranks_or_scores():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(8, 30, generator=g)
    target = torch.randint(1, 30, (8,), generator=g)
    a, b = RankingMetric(8), RankingMetric(8)
    a.update(scores, target, torch.arange(8))
    b.update(None, target, torch.arange(8), ranks=full_ranks(scores, target))
    assert a.compute() == b.compute()
    with pytest.raises(ValueError, match="either scores or ranks"):
        b.update(scores, target, torch.arange(8), ranks=full_ranks(scores, target))
    with pytest.raises(ValueError, match="either scores or ranks"):
        b.update(None, target, torch.arange(8))
    with pytest.raises(ValueError, match="ranks must be"):
        b.update(None, target, torch.arange(8), ranks=-torch.ones(8, dtype=torch.long))
