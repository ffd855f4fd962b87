"""The recommendation LightningModule: losses fall, training beats popularity, reports."""

from __future__ import annotations

import json
from functools import partial

import lightning as L
import pytest
import torch

from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.metrics import RankingMetric, target_ranks
from bft_lightning.models import BERT4Rec, SASRec
from bft_lightning.tasks import SequentialRecommendation
from bft_lightning.tasks.recommendation import trim_left_padding


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


@pytest.mark.parametrize("precision", ["off", "on"])
def test_prefix_rows_give_the_same_targets_and_losses(precision: str) -> None:
    """With positions counted from the first item, a causal model's output for a
    target does not depend on later items, so serving each target in its own
    prefix row (loss at its last position) sums to the same loss as one row per
    user; only the compute per epoch differs."""
    torch.manual_seed(0)
    backbone = partial(SASRec, precision=precision, d_model=16, positions="from_start")
    task = SequentialRecommendation(100, 40, backbone=backbone).eval()
    totals = {}
    for rows in ("user", "prefix"):
        dm = small_data(max_len=40, synthetic_users=60, synthetic_items=100, train_rows=rows)
        dm.setup("fit")
        total, count = torch.zeros((), dtype=torch.float64), 0
        with torch.no_grad():
            for batch in dm.train_dataloader():
                ids, labels, times = task.model.train_view(trim_left_padding(batch))
                hidden, log_prec = task.model.encode(ids, times)
                sel = labels > 0
                lp = None if log_prec is None else log_prec[sel]
                total += task.loss(hidden[sel], labels[sel], lp).double() * int(sel.sum())
                count += int(sel.sum())
        totals[rows] = (total.item(), count)
    longest = int(dm.sequences.lengths.max())
    assert longest - 2 <= 41, "user rows must hold every training part whole"
    assert totals["user"][1] == totals["prefix"][1] > 100
    assert totals["prefix"][0] == pytest.approx(totals["user"][0], rel=1e-5)


def test_rows_normalization_weighs_every_target_alike() -> None:
    """A per-target mean weighs a target by 1 / its batch's target count; dividing
    the sum by the rows weighs every target alike (batches of equal rows)."""
    torch.manual_seed(0)
    seqs = torch.tensor([[0, 0, 0, 0, 3, 4], [0, 0, 0, 0, 5, 6], [1, 2, 3, 4, 5, 6]])
    short, long = {"seq": seqs[:2]}, {"seq": seqs[2:].expand(2, -1)}  # 1 and 5 targets a row
    values = {}
    for norm in ("targets", "rows"):
        torch.manual_seed(0)
        task = SequentialRecommendation(
            6, 5, backbone=partial(SASRec, d_model=16, dropout=0.0), loss_normalization=norm
        )
        values[norm] = [task.training_step(b, 0) for b in (short, long)]
    for t, r, per_row in zip(values["targets"], values["rows"], (1, 5)):
        assert r.item() == pytest.approx(t.item() * per_row, rel=1e-6)
    with pytest.raises(ValueError, match="loss_normalization"):
        SequentialRecommendation(6, 5, loss_normalization="users")


def test_checkpoint_from_before_the_option_resumes_with_per_target_means(tmp_path) -> None:
    dm = small_data(synthetic_users=100, synthetic_items=100)
    task = SequentialRecommendation(dm.num_items, 20, backbone=partial(SASRec, d_model=16))
    tr = trainer(tmp_path, max_steps=1, limit_val_batches=0)
    tr.fit(task, dm)
    path = tmp_path / "model.ckpt"
    tr.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["hyper_parameters"]["loss_normalization"] == "rows"
    loaded = SequentialRecommendation.load_from_checkpoint(
        path, backbone=partial(SASRec, d_model=16)
    )
    assert loaded.loss_normalization == "rows"
    del ckpt["hyper_parameters"]["loss_normalization"]  # as saved by earlier versions
    torch.save(ckpt, path)
    old = SequentialRecommendation.load_from_checkpoint(path, backbone=partial(SASRec, d_model=16))
    assert old.loss_normalization == "targets"


def test_bert4rec_trains_and_ranks(tmp_path) -> None:
    torch.manual_seed(0)
    dm = small_data()
    task = SequentialRecommendation(
        dm.num_items, 20, backbone=partial(BERT4Rec, precision="on", d_model=32, mask_prob=0.3),
        lr=3e-3,
    )  # fmt: skip
    # 15 epochs: a cloze model learns from 30% of the positions, and on the linear-time
    # generator's data it is still at popularity level after 4 (0.112 against 0.121)
    tr = trainer(tmp_path, max_epochs=15, limit_val_batches=0)
    tr.fit(task, dm)
    tr.test(task, dm, verbose=False)
    assert task.test_results["ndcg@10"] > popularity_metrics(dm)["ndcg@10"]


def test_mask_history_excludes_seen_items(tmp_path) -> None:
    """Excluding the input window's items can only lift the target: the same model
    with the mask ranks every user at least as high, and some strictly higher."""
    dm = small_data()
    results = {}
    for mask in (False, True):
        torch.manual_seed(0)
        task = SequentialRecommendation(
            dm.num_items, 20, backbone=partial(SASRec, d_model=16), mask_history=mask
        )
        trainer(tmp_path).test(task, dm, verbose=False)
        results[mask] = task.test_results
    assert results[True]["n"] == results[False]["n"] > 0
    assert results[True]["mrr"] > results[False]["mrr"]
    assert results[True]["hr@10"] >= results[False]["hr@10"]


def eval_ranks(task: SequentialRecommendation, batch: dict) -> torch.Tensor:
    """The targets' ranks the task's evaluation step hands to its ranking metric."""
    captured = {}

    class Capture:
        def update(self, scores, *args, ranks=None, **kwargs):
            captured["ranks"] = ranks

    with torch.no_grad():
        task._eval_step(batch, Capture())  # type: ignore[arg-type]
    return captured["ranks"]


def eval_batch(num_items: int = 200, b: int = 4, t: int = 20) -> dict:
    return {
        "input_ids": torch.randint(1, num_items + 1, (b, t)),
        "target": torch.randint(1, num_items + 1, (b,)),
        "user": torch.arange(b),
    }


def test_eval_ranks_are_those_of_float32_scores_under_bf16_autocast() -> None:
    """Under bf16 autocast the encoder runs in bf16, but the target is ranked among
    float32 scores (a bf16 score matrix ties many items with the target)."""
    torch.manual_seed(0)
    task = SequentialRecommendation(200, 20, backbone=partial(SASRec, d_model=16)).eval()
    batch = eval_batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ranks = eval_ranks(task, batch)
        hidden, _ = task.model.last_hidden(batch["input_ids"])
    with torch.no_grad():
        want = task.model.score(hidden.float())  # outside autocast: float32 throughout
    assert torch.equal(ranks, target_ranks(want, batch["target"]))


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


def test_cosine_schedule_without_a_run_length_is_refused(tmp_path) -> None:
    """A cosine decay over an endless run (max_epochs = max_steps = -1) has no length:
    refused with a message naming the settings, not an OverflowError."""
    dm = small_data(synthetic_users=100)
    task = SequentialRecommendation(
        dm.num_items, 20, backbone=partial(SASRec, d_model=16), cosine=True
    )
    with pytest.raises(ValueError, match="max_epochs or trainer.max_steps"):
        trainer(tmp_path, max_epochs=-1, max_steps=-1).fit(task, dm)


def test_eval_step_runs_on_a_bf16_model() -> None:
    """Lightning's ``bf16-true`` casts the weights: evaluation scores in their dtype
    (an upcast of the states alone met bf16 item weights and failed)."""
    torch.manual_seed(0)
    task = SequentialRecommendation(200, 20, backbone=partial(SASRec, d_model=16)).eval()
    task = task.to(torch.bfloat16)
    batch = eval_batch()
    ranks = eval_ranks(task, batch)
    with torch.no_grad():
        hidden, _ = task.model.last_hidden(batch["input_ids"])
        want = target_ranks(task.model.score(hidden).float(), batch["target"])
    assert torch.equal(ranks, want)


def test_a_second_fit_continues_from_the_learned_prior(tmp_path) -> None:
    """The frequency init of the prior runs at the first fit only: fitting the same
    module again (more epochs, no checkpoint) keeps the log tau it learned."""
    dm = small_data(synthetic_users=300, synthetic_items=100, batch_size=64)
    backbone = partial(SASRec, precision="on", d_model=16, prior_init="frequency")
    task = SequentialRecommendation(dm.num_items, 20, backbone=backbone, lr=1e-2)
    trainer(tmp_path, max_steps=3, limit_val_batches=0).fit(task, dm)
    learned = task.model.prior.log_tau.weight.detach().clone()
    trainer(tmp_path, max_steps=0, limit_val_batches=0).fit(task, dm)  # set-up, no step
    torch.testing.assert_close(task.model.prior.log_tau.weight, learned, rtol=0, atol=0)
    fresh = SequentialRecommendation(dm.num_items, 20, backbone=backbone)
    trainer(tmp_path, max_steps=0, limit_val_batches=0).fit(fresh, dm)
    assert (fresh.model.prior.log_tau.weight - learned).abs().max() > 1e-3  # it did learn
