"""DDP gives the results of one process: 2 CPU processes (``ddp_fork``, gloo) in pytest.

- Full-ranking test metrics of 2 processes equal those of 1 process on the same
  checkpoint exactly, with every user counted once although the sampler pads.
- Training with 2 processes x batch b follows 1 process x batch 2b step by step:
  the bucket sampler forms the same global batches, and the loss is the sum over
  the global batch divided by its rows (or targets) whatever their split between
  processes.
"""

from __future__ import annotations

import math
from functools import partial

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch import Callback

from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.datamodules.recommendation import (
    DistributedLengthBucketSampler,
    LengthBucketSampler,
)
from bft_lightning.models import SASRec
from bft_lightning.nn.stats import find_filter_layers
from bft_lightning.tasks import SequentialRecommendation

pytestmark = pytest.mark.filterwarnings("ignore")

MAX_LEN = 12


class OneThread(Callback):
    """One torch thread in every (forked) process."""

    def setup(self, trainer, pl_module, stage) -> None:  # type: ignore[no-untyped-def]
        torch.set_num_threads(1)


def data(batch_size: int, users: int = 301) -> SequenceDataModule:
    # 301 users: an odd number of evaluated users, so DistributedSampler repeats one
    return SequenceDataModule(
        max_len=MAX_LEN,
        batch_size=batch_size,
        eval_batch_size=40,
        synthetic_users=users,
        synthetic_items=120,
    )


def task(num_items: int) -> SequentialRecommendation:
    backbone = partial(
        SASRec, d_model=16, nhead=2, num_layers=2, dim_feedforward=32, dropout=0.0, precision="on"
    )
    return SequentialRecommendation(num_items, MAX_LEN, backbone=backbone, lr=3e-3)


def trainer(tmp_path, devices: int, **kw) -> L.Trainer:
    opts = dict(
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=[OneThread()],
        deterministic=True,
    )
    if devices > 1:
        opts["strategy"] = "ddp_fork"
    opts.update(kw)
    return L.Trainer(**opts)


# ----------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("pool_batches", [50, 1])
def test_sharded_bucket_batches_are_shares_of_one_process_batches(world, pool_batches):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=203)
    b = 8
    one = LengthBucketSampler(lengths, world * b, seed=5, pool_batches=pool_batches)
    ranks = [
        DistributedLengthBucketSampler(
            lengths, b, seed=5, pool_batches=pool_batches, num_replicas=world, rank=r
        )
        for r in range(world)
    ]
    for epoch in (0, 3):  # set_epoch pins the order on every rank
        one.set_epoch(epoch)
        for s in ranks:
            s.set_epoch(epoch)
        single = list(one)
        shards = [list(s) for s in ranks]
        assert {len(x) for x in shards} == {math.ceil(len(lengths) / world)}
        batches = math.ceil(len(lengths) / (world * b))
        for i in range(batches - 1):  # the last global batch holds the padding
            union = sorted(x for s in shards for x in s[i * b : (i + 1) * b])
            assert union == sorted(single[i * world * b : (i + 1) * world * b]), (epoch, i)
        seen = [x for s in shards for x in s]
        assert set(seen) == set(range(len(lengths)))  # every row, padding repeats a few
        assert len(seen) - len(lengths) < world
    assert list(one) != single  # without set_epoch, the next pass reshuffles


def test_one_replica_order_is_pools_sorted_into_batches_with_the_short_one_last():
    lengths = np.random.default_rng(1).integers(1, 30, size=100)
    s = LengthBucketSampler(lengths, 16, seed=2)
    rng = np.random.default_rng(2)
    order = rng.permutation(100)
    pools = [order[i : i + 800] for i in range(0, 100, 800)]
    batches = []
    for pool in pools:
        pool = pool[np.argsort(lengths[pool], kind="stable")]
        batches += [pool[i : i + 16] for i in range(0, len(pool), 16)]
    full, short = batches[:-1], batches[-1]  # 100 = 6 x 16 + 4
    expected = np.concatenate([full[k] for k in rng.permutation(len(full))] + [short]).tolist()
    got = list(s)
    assert got == expected
    # every loader batch is one bucket: its rows are consecutive in the sorted pool
    ranks = {int(x): i for i, x in enumerate(np.concatenate(batches))}
    for i in range(0, 100, 16):
        pos = sorted(ranks[x] for x in got[i : i + 16])
        assert pos == list(range(pos[0], pos[0] + len(pos)))


def test_datamodule_shards_training_rows_over_the_trainer_ranks():
    dm = data(batch_size=10)
    dm.setup("fit")

    class FakeTrainer:
        world_size, global_rank = 2, 1

    dm.trainer = FakeTrainer()  # type: ignore[assignment]
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, DistributedLengthBucketSampler)  # Lightning keeps it
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, 1)
    assert len(loader.sampler) == math.ceil(len(dm._dataset("train")) / 2)


# ----------------------------------------------------------------------------- metrics
def test_two_process_test_metrics_equal_one_process_on_same_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    L.seed_everything(0)
    dm = data(batch_size=32)
    model = task(dm.num_items)
    fit = trainer(tmp_path, 1, max_steps=6, limit_val_batches=0)
    fit.fit(model, dm)
    ckpt = tmp_path / "model.ckpt"
    fit.save_checkpoint(ckpt)

    results = {}
    for devices in (1, 2):
        dm_run = data(batch_size=32)
        model_run = task(dm_run.num_items)  # fresh weights: the checkpoint must load
        (out,) = trainer(tmp_path, devices).test(model_run, dm_run, ckpt_path=str(ckpt))
        results[devices] = out
    one, two = results[1], results[2]
    evaluated = len(dm._dataset("test"))
    assert evaluated % 2 == 1  # the 2-process sampler repeated a user ...
    assert one["test/n"] == two["test/n"] == evaluated  # ... counted once
    assert one.keys() == two.keys() and len(one) > 30
    assert "test/gain" in one and "test/item_q0/hr@10" in one
    assert one == two  # exactly: every metric, every stratum


# ----------------------------------------------------------------------------- training
class SGDTask(SequentialRecommendation):
    """Plain SGD: weight differences are gradient differences (AdamW divides by sqrt(v),
    which turns round-off in parameters whose gradient is 0, such as attention key
    biases, into steps of up to ``lr * noise / eps``)."""

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit_steps(
    tmp_path,
    devices: int,
    batch_size: int,
    precision: str,
    sgd: bool,
    steps: int = 4,
    normalization: str = "rows",
) -> dict[str, torch.Tensor]:
    L.seed_everything(0)
    dm = data(batch_size=batch_size, users=300)  # an even number of training rows: no padding
    backbone = partial(
        SASRec,
        d_model=16,
        nhead=2,
        num_layers=2,
        dim_feedforward=32,
        dropout=0.0,
        precision=precision,
    )
    model = (SGDTask if sgd else SequentialRecommendation)(
        dm.num_items, MAX_LEN, backbone=backbone, lr=3e-3, loss_normalization=normalization
    )
    if sgd:  # the running sill is a BatchNorm-like statistic of each process's own batch
        for _, layer in find_filter_layers(model.model):
            layer.sill_momentum = 0.0
    tr = trainer(tmp_path, devices, max_steps=steps, limit_val_batches=0)
    tr.fit(model, dm)  # under ddp_fork, rank 0's final weights come back to this process
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize(
    ("precision", "normalization"), [("off", "rows"), ("on", "rows"), ("on", "targets")]
)
def test_two_processes_batch_b_take_the_steps_of_one_process_batch_2b(
    tmp_path, monkeypatch, precision, normalization
):
    """Same global batches, same loss (sum over its rows or its targets, divided by
    their global count): the same gradients."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    b = 16
    L.seed_everything(0)
    # the same data as fit_steps: the synthetic generator draws items, so the item
    # count can differ with the number of users (119 of 120 at 301 users, 120 at 300)
    start = {
        k: p.detach().clone() for k, p in task(data(b, users=300).num_items).named_parameters()
    }
    ddp = fit_steps(tmp_path, 2, b, precision, sgd=True, normalization=normalization)
    one = fit_steps(tmp_path, 1, 2 * b, precision, sgd=True, normalization=normalization)
    other = fit_steps(tmp_path, 1, b, precision, sgd=True, normalization=normalization)
    assert max_diff(one, start) > 1e-2 and max_diff(other, one) > 1e-2  # both matter ...
    assert max_diff(ddp, one) < 1e-6  # ... and only round-off separates DDP from one process


def test_two_processes_follow_one_process_with_adamw_and_running_sill(tmp_path, monkeypatch):
    """The shipped set-up (AdamW, BFT with its running sill): equal within round-off.

    The running sill's moments are summed over the processes, so it equals the
    one-process sill. The keys' in-projection bias is left out: softmax does not
    change when a key bias is added to every score of a row, so its gradient is
    zero up to round-off, which AdamW's normalisation turns into steps of ~1e-4
    that differ between any two summation orders.
    """
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    b = 16
    ddp = fit_steps(tmp_path, 2, b, "on", sgd=False)
    one = fit_steps(tmp_path, 1, 2 * b, "on", sgd=False)
    other = fit_steps(tmp_path, 1, b, "on", sgd=False)
    for params in (ddp, one, other):
        for name, value in params.items():
            if name.endswith("in_proj_bias"):
                d = value.shape[0] // 3
                params[name] = torch.cat([value[:d], value[2 * d :]])  # queries, values
    assert max_diff(ddp, one) < 1e-6
    assert max_diff(other, one) > 1e-3


def test_hstu_without_timestamps_trains_under_plain_ddp(tmp_path, monkeypatch):
    """HSTU's time-bucket weights get no gradient on data without timestamps; plain
    DDP (no ``find_unused_parameters``) stops on such a parameter in its second step
    unless the task anchors it."""
    from bft_lightning.models import HSTU

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rng = torch.Generator().manual_seed(0)
    lines = [  # S3-Rec format: 'user item item ...', no timestamps
        " ".join(map(str, [u, *torch.randint(1, 60, (8,), generator=rng).tolist()]))
        for u in range(1, 201)
    ]
    (tmp_path / "seqs.txt").write_text("\n".join(lines) + "\n")
    dm = SequenceDataModule(
        path=str(tmp_path / "seqs.txt"), format="s3rec", max_len=MAX_LEN, batch_size=16
    )
    backbone = partial(HSTU, d_model=16, nhead=2, num_layers=1, dropout=0.0, precision="on")
    model = SequentialRecommendation(dm.num_items, MAX_LEN, backbone=backbone, lr=3e-3)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    tr = trainer(tmp_path, 2, max_steps=3, limit_val_batches=0, strategy="ddp_fork")
    tr.fit(model, dm)  # stopped in its second step before (rank 0's weights come back)
    after = dict(model.named_parameters())
    moved = {k: (after[k].detach() - p).abs().max().item() for k, p in before.items()}
    assert all(v == 0.0 for k, v in moved.items() if "time_weight" in k), moved
    assert moved["model.item_emb.weight"] > 0 and moved["model.encoder.layers.0.rab.pos_weight"] > 0
