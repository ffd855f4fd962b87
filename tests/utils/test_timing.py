"""EpochTimer: training time per epoch, the epoch's validation left out."""

from __future__ import annotations

import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from bft_lightning.utils import EpochTimer


class SlowValidation(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return (self.w - batch.float().mean()).square()

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        time.sleep(1.0)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_validation_is_not_counted_in_the_epoch_time(tmp_path) -> None:
    """Each validation sleeps 1 s (the sanity check and epoch 2's): epochs of two tiny
    steps stay far below that, the validated one included."""
    data = DataLoader(torch.arange(4), batch_size=2)
    timer = EpochTimer()
    trainer = L.Trainer(
        max_epochs=3, check_val_every_n_epoch=2, limit_val_batches=1, num_sanity_val_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(SlowValidation(), data, data)
    assert len(timer.times) == 3
    assert max(timer.times) < 0.9  # a counted validation alone would be >= 1 s
