"""The recommendation LightningModule: losses fall, training beats popularity, reports."""

from __future__ import annotations

import json
from functools import partial

import lightning as L
import pytest
import torch

from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.metrics import RankingMetric
from bft_lightning.models import BERT4Rec, SASRec
from bft_lightning.tasks import SequentialRecommendation


def small_data(**kw) -> SequenceDataModule:
    opts = dict(max_len=20, batch_size=128, synthetic_users=800, synthetic_items=200)
    opts.update(kw)
    return SequenceDataModule(**opts)


def trainer(tmp_path, **kw) -> L.Trainer:
    opts = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
    )  # fmt: skip
    opts.update(kw)
    return L.Trainer(**opts)


def popularity_metrics(dm: SequenceDataModule) -> dict:
    dm.setup("test")
    metric = RankingMetric(len(dm.test_dataloader().dataset), item_frequency=dm.item_frequency)
    scores = dm.item_frequency.float() + torch.rand(dm.num_items + 1) * 1e-3  # break ties
    for batch in dm.test_dataloader():
        b = len(batch["target"])
        metric.update(scores.expand(b, -1), batch["target"], batch["user"], batch["history_len"])
    return metric.compute()


@pytest.mark.parametrize("precision", ["off", "on"])
def test_sasrec_beats_popularity(tmp_path, precision: str) -> None:
    torch.manual_seed(0)
    dm = small_data()
    task = SequentialRecommendation(
        dm.num_items, 20, backbone=partial(SASRec, precision=precision, d_model=32),
        lr=3e-3, report_dir=str(tmp_path / "report"),
    )  # fmt: skip
    tr = trainer(tmp_path, max_epochs=6, limit_val_batches=0)
    tr.fit(task, dm)
    tr.test(task, dm, verbose=False)
    got, pop = task.test_results, popularity_metrics(dm)
    assert got["ndcg@10"] > pop["ndcg@10"] + 0.05, (got["ndcg@10"], pop["ndcg@10"])
    assert got["n"] == pop["n"] == len(dm.test_dataloader().dataset)
    written = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert written["hr@10"] == pytest.approx(got["hr@10"])
    assert (tmp_path / "report" / "metrics.md").exists()
    assert (tmp_path / "report" / "strata.png").stat().st_size > 1000
    assert ("gain" in got) == (precision == "on")
    if precision == "on":
        assert 0 < got["gain"] < 1


@pytest.mark.parametrize("loss", ["ce", "bce", "sampled_softmax"])
def test_losses_fall(tmp_path, loss: str) -> None:
    torch.manual_seed(0)
    dm = small_data(synthetic_users=300, synthetic_items=100, batch_size=64)
    dm.setup("fit")
    task = SequentialRecommendation(
        dm.num_items, 20, backbone=partial(SASRec, precision="on", d_model=32), loss=loss,
        num_negatives=20, lr=3e-3,
    )  # fmt: skip
    opt = task.configure_optimizers()
    batches = [b for _, b in zip(range(2), dm.train_dataloader())]
    losses = []
    for _ in range(12):
        for b in batches:
            opt.zero_grad()
            loss_value = task.training_step(b, 0)
            loss_value.backward()
            opt.step()
        losses.append(float(loss_value))
    assert losses[-1] < 0.8 * losses[0]


def test_bert4rec_trains_and_ranks(tmp_path) -> None:
    torch.manual_seed(0)
    dm = small_data()
    task = SequentialRecommendation(
        dm.num_items, 20, backbone=partial(BERT4Rec, precision="on", d_model=32, mask_prob=0.3),
        lr=3e-3,
    )  # fmt: skip
    tr = trainer(tmp_path, max_epochs=4, limit_val_batches=0)
    tr.fit(task, dm)
    tr.test(task, dm, verbose=False)
    assert task.test_results["ndcg@10"] > popularity_metrics(dm)["ndcg@10"]


def test_mask_history_excludes_seen_items(tmp_path) -> None:
    dm = small_data()
    task = SequentialRecommendation(
        dm.num_items, 20, backbone=partial(SASRec, d_model=16), mask_history=True
    )
    tr = trainer(tmp_path, max_epochs=1, limit_train_batches=1)
    tr.test(task, dm, verbose=False)
    assert task.test_results["n"] > 0


def test_precision_parameters_get_their_own_learning_rate() -> None:
    task = SequentialRecommendation(
        50, 10, backbone=partial(SASRec, precision="on", d_model=16), lr=1e-3, prior_lr_scale=10
    )
    opt = task.configure_optimizers()
    lrs = sorted(g["lr"] for g in opt.param_groups)
    assert lrs[-1] == pytest.approx(1e-2)
    prior_group = max(opt.param_groups, key=lambda g: g["lr"])
    assert any(p is task.model.prior.log_tau.weight for p in prior_group["params"])


def test_unknown_loss_is_named() -> None:
    with pytest.raises(ValueError, match="loss"):
        SequentialRecommendation(10, 5, loss="hinge")
