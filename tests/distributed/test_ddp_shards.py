"""``shard_users=True``: each DDP rank builds only its users' rows; together, every row once.

- Without processes: the shards' training, validation and test rows, over the
  ranks, are exactly one process's rows (each user in one shard), and every
  rank runs the same number of training steps.
- With 2 CPU processes (``ddp_fork``, gloo): test metrics from sharded
  evaluation equal those of one process on the same checkpoint, and a
  sharded fit (training + validation) runs to the end on both ranks.
"""

from __future__ import annotations

from functools import partial

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch import Callback

from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.datamodules.shards import (
    EvalShard,
    ShardBucketSampler,
    ShardSampler,
    user_bounds,
)
from bft_lightning.models import SASRec
from bft_lightning.tasks import SequentialRecommendation

pytestmark = pytest.mark.filterwarnings("ignore")

MAX_LEN = 12


def data(shard: bool, rows: str = "user", users: int = 301) -> SequenceDataModule:
    return SequenceDataModule(
        max_len=MAX_LEN, batch_size=16, eval_batch_size=40, synthetic_users=users,
        synthetic_items=120, shard_users=shard, train_rows=rows,
    )  # fmt: skip


class FakeTrainer:
    def __init__(self, world: int, rank: int) -> None:
        self.world_size, self.global_rank = world, rank


def _ranks(world: int, rows: str) -> list[SequenceDataModule]:
    out = []
    for rank in range(world):
        dm = data(True, rows)
        dm.trainer = FakeTrainer(world, rank)  # type: ignore[assignment]
        out.append(dm)
    return out


def _all_rows(ds) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    if isinstance(ds, EvalShard):
        return ds.__getitems__(list(range(ds.start, ds.stop)))
    return ds.__getitems__(list(range(len(ds))))


def test_user_bounds_partition_users_and_balance_interactions():
    rng = np.random.default_rng(0)
    lengths = rng.geometric(0.1, size=1000)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for world in (1, 2, 3, 8):
        b = user_bounds(offsets, world)
        assert b[0] == 0 and b[-1] == 1000 and np.all(np.diff(b) >= 0)
        share = np.diff(offsets[b])
        assert np.all(np.abs(share - offsets[-1] / world) <= lengths.max())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("rows", ["user", "prefix"])
def test_shards_hold_every_row_once(world, rows):
    one = data(False, rows)
    ranks = _ranks(world, rows)
    for name in ("train", "val", "test"):
        full = _all_rows(one._dataset(name))
        parts = [_all_rows(dm._dataset(name)) for dm in ranks]
        for key, value in full.items():  # contiguous shards: rank order is the full order
            joined = np.concatenate([p[key] for p in parts])
            assert np.array_equal(joined, value), (name, key)
    val = [dm._dataset("val") for dm in ranks]
    assert all(len(v) == len(one._dataset("val")) for v in val)  # the whole set's numbering
    users = np.concatenate([_all_rows(v)["user"] for v in val])
    assert users.tolist() == list(range(len(one._dataset("val"))))  # each user once
    # every rank: its own rows only, and the same number of steps
    steps = set()
    for dm in ranks:
        train = dm.train_dataloader()
        assert isinstance(train.sampler, ShardBucketSampler)
        local = list(train.sampler)
        assert set(local) == set(range(len(dm._dataset("train"))))  # every local row, padded
        steps.add(len(train))
        loader = dm.val_dataloader()
        assert isinstance(loader.sampler, ShardSampler)
        assert sum(len(b["user"]) for b in loader) == len(dm._dataset("val").arrays["user"])
    assert len(steps) == 1


# ----------------------------------------------------------------------------- 2 processes
class OneThread(Callback):
    def setup(self, trainer, pl_module, stage) -> None:  # type: ignore[no-untyped-def]
        torch.set_num_threads(1)


def task(num_items: int) -> SequentialRecommendation:
    backbone = partial(
        SASRec, d_model=16, nhead=2, num_layers=2, dim_feedforward=32, dropout=0.0, precision="on"
    )
    return SequentialRecommendation(num_items, MAX_LEN, backbone=backbone, lr=3e-3)


def trainer(tmp_path, devices: int, **kw) -> L.Trainer:  # type: ignore[no-untyped-def]
    opts = dict(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=tmp_path, deterministic=True,
    )  # fmt: skip
    if devices > 1:
        opts["strategy"] = "ddp_fork"
    opts.update(kw)
    opts["callbacks"] = [OneThread(), *opts.get("callbacks", [])]
    return L.Trainer(**opts)


def test_two_process_sharded_metrics_equal_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    L.seed_everything(0)
    dm = data(False)
    fit = trainer(tmp_path, 1, max_steps=6, limit_val_batches=0)
    fit.fit(task(dm.num_items), dm)
    ckpt = tmp_path / "model.ckpt"
    fit.save_checkpoint(ckpt)

    (one,) = trainer(tmp_path, 1).test(task(dm.num_items), data(False), ckpt_path=str(ckpt))
    (two,) = trainer(tmp_path, 2).test(task(dm.num_items), data(True), ckpt_path=str(ckpt))
    assert one["test/n"] == two["test/n"] == len(dm._dataset("test"))  # each user once
    assert len(one) > 30 and one == two  # every metric, every stratum, exactly

    # a sharded fit (training and validation on both ranks) runs to its end
    run = trainer(tmp_path, 2, max_epochs=1, limit_train_batches=3)
    run.fit(task(dm.num_items), data(True))  # (a rank with more steps than the other would hang)
    assert run.state.finished and torch.isfinite(run.callback_metrics["train/loss"])
    assert int(run.callback_metrics["val/n"]) == len(dm._dataset("val"))
