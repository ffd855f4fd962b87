"""Every loss a config can pick trains: its loss falls over a few hundred steps and the
model beats random ranking on the synthetic data (full-ranking HR@10)."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch

from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.models import SASRec
from bft_lightning.tasks import SequentialRecommendation


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["train/loss"]))


@pytest.mark.parametrize(
    ("loss", "options"),
    [
        ("ce_chunked", {"loss_chunk": 37}),
        ("sampled_softmax_logq", {"negatives": "popularity"}),
        ("sampled_softmax_logq", {"negatives": "uniform"}),
        ("sampled_softmax_logq", {"negatives": "in_batch"}),
    ],
)
def test_new_losses_fall_quickly(loss: str, options: dict) -> None:
    """A quick check for the default run: 24 steps on two batches lower the loss."""
    torch.manual_seed(0)
    dm = SequenceDataModule(max_len=20, batch_size=64, synthetic_users=300, synthetic_items=100)
    dm.setup("fit")
    task = SequentialRecommendation(
        dm.num_items, 20, backbone=partial(SASRec, precision="on", d_model=32), loss=loss,
        num_negatives=20, lr=3e-3, **options,
    )  # fmt: skip
    task.criterion.set_item_frequency(dm.item_frequency)
    opt = task.configure_optimizers()
    batches = [b for _, b in zip(range(2), dm.train_dataloader())]
    losses = []
    for _ in range(12):
        for b in batches:
            opt.zero_grad()
            value = task.training_step(b, 0)
            value.backward()
            opt.step()
        losses.append(float(value))
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss", "options"),
    [
        ("ce", {}),
        ("ce_chunked", {"loss_chunk": 37}),
        ("sampled_softmax_logq", {"negatives": "popularity"}),
        ("sampled_softmax_logq", {"negatives": "uniform"}),
        ("sampled_softmax_logq", {"negatives": "in_batch"}),
        ("sampled_softmax", {}),
        ("bce", {}),
    ],
)
def test_loss_falls_and_beats_random(tmp_path, loss: str, options: dict) -> None:
    torch.manual_seed(0)
    dm = SequenceDataModule(max_len=20, batch_size=32, synthetic_users=400, synthetic_items=120)
    task = SequentialRecommendation(
        dm.num_items, 20, backbone=partial(SASRec, d_model=24, num_layers=1), loss=loss,
        num_negatives=16, lr=5e-3, **options,
    )  # fmt: skip
    record = _Losses()
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        max_steps=200, default_root_dir=tmp_path, callbacks=[record],
    )  # fmt: skip
    trainer.fit(task, dm)
    trainer.test(task, dm, verbose=False)
    first, last = record.values[:15], record.values[-15:]
    assert len(record.values) == 200
    assert sum(last) < 0.85 * sum(first), (first, last)
    random_hr = 10 / dm.num_items
    assert task.test_results["hr@10"] > 2 * random_hr, (task.test_results["hr@10"], random_hr)
    if loss == "sampled_softmax_logq" and options["negatives"] == "popularity":
        assert task.criterion.frequency is not None  # the data's counts reached the loss
