"""The task's validation with the last layer at the predicting position only gives the
metrics of the whole computation (every backbone, precision off and on, mask_history)."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.tasks import SequentialRecommendation

N, LEN, USERS = 60, 10, 96


def loader(timed: bool) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, N + 1, (USERS, LEN), generator=g)
    lengths = torch.randint(1, LEN + 1, (USERS,), generator=g)
    ids = ids * (torch.arange(LEN) >= LEN - lengths.unsqueeze(1))
    target = torch.randint(1, N + 1, (USERS,), generator=g)
    times = 1_600_000_000 + (10 ** (torch.rand(USERS, LEN, generator=g) * 6)).long().cumsum(1)
    rows = []
    for u in range(USERS):
        row = {"input_ids": ids[u], "target": target[u], "user": torch.tensor(u),
               "history_len": lengths[u]}  # fmt: skip
        if timed:
            row["input_time"] = times[u] * (ids[u] != 0)
        rows.append(row)
    return DataLoader(rows, batch_size=32)


def validate(task: SequentialRecommendation, data: DataLoader) -> dict[str, float]:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    return trainer.validate(task, dataloaders=data, verbose=False)[0]


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec, HSTU])
@pytest.mark.parametrize("precision", ["off", "on"])
def test_validation_metrics_equal_the_whole_computation(cls, precision: str) -> None:
    torch.manual_seed(0)
    backbone = partial(cls, d_model=16, nhead=2, num_layers=2, dim_feedforward=32,
                       precision=precision)  # fmt: skip
    task = SequentialRecommendation(N, LEN, backbone=backbone)
    data = loader(timed=cls is HSTU)
    short_path = task.model.last_hidden
    for mask in (False, True):
        task.mask_history = mask
        task.model.last_hidden = short_path  # type: ignore[method-assign]
        fast = validate(task, data)
        task.model.last_hidden = partial(short_path, last_only=False)  # type: ignore[method-assign]
        full = validate(task, data)
        assert fast.keys() == full.keys() and fast
        for name in fast:
            if name.endswith(("hr@1", "hr@5", "hr@10", "hr@20", "ndcg@10", "mrr")):
                assert fast[name] == full[name], name
            else:
                assert fast[name] == pytest.approx(full[name], rel=1e-5, abs=1e-6), name
