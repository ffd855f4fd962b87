"""callbacks/summary.py stop_reason: the stop is named by the cap that ended the run."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping

from bft_lightning.callbacks.summary import stop_reason


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return (self.w - 1).pow(2).sum()

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("val/x", self.w.detach().sum())

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(**trainer_kw) -> str:  # type: ignore[no-untyped-def]
    data = torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=1)
    trainer = L.Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[EarlyStopping("val/x", mode="max", patience=100)], **trainer_kw,
    )  # fmt: skip
    trainer.fit(_Tiny(), data, data)
    return stop_reason(trainer)[1]


def test_a_run_ended_by_its_time_cap_says_max_time_not_max_epochs():
    said = _fit(max_time={"seconds": 0}, max_epochs=50)
    assert "max_time" in said and "--trainer.max_time" in said and "max_epochs" not in said


def test_a_run_ended_by_its_epoch_cap_says_max_epochs():
    said = _fit(max_epochs=2)
    assert "max_epochs=2" in said and "--trainer.max_epochs" in said
