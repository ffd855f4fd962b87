"""Under 2-process CPU DDP the logged histograms equal those of one process on the same data.

The data module gives rank ``r`` of ``w`` the batches ``r::w``, so both runs see
the same batches. The model is frozen (``lr=0``, no running sill update, no
dropout), so the single-process run, which sees the two training batches in
two steps, measures the same weights as the DDP run does in one step.
"""

import csv

import pytest
import torch
from lightning.pytorch import LightningDataModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tb_events import read_events
from test_callbacks_attention_sink import sink_pattern
from torch.utils.data import DataLoader
from toy_bft import (
    FAST,
    OneThread,
    RankBatches,
    ScriptedModule,
    ToyBFT,
    make_batch,
    make_batches,
)

from bft_lightning.callbacks import (
    AttentionSinkMonitor,
    GainByContextLength,
    GainByStratum,
    PrecisionMonitor,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def run(tmp_path, name: str, devices: int, max_steps: int) -> dict:
    seed_everything(0)
    model = ToyBFT(lr=0.0, sill_momentum=0.0)
    data = RankBatches(make_batches(2, length=12), make_batches(4, seed=10, length=12))
    monitor = PrecisionMonitor(every_n_steps=1, log_on_validation=True)
    logger = TensorBoardLogger(str(tmp_path), name=name, version=0)
    opts = {**FAST, "devices": devices, "use_distributed_sampler": False, "logger": logger}
    if devices > 1:
        opts["strategy"] = "ddp_fork"
    trainer = Trainer(callbacks=[OneThread(), monitor], max_steps=max_steps, **opts)
    trainer.fit(model, data)
    return read_events(logger.log_dir)[0]


def test_ddp_histograms_equal_single_process_histograms(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ddp = run(tmp_path, "ddp", devices=2, max_steps=1)
    one = run(tmp_path, "one", devices=1, max_steps=2)
    val_tags = sorted(t for t in one if t.startswith("bft_val/"))
    train_tags = sorted(t for t in one if t.startswith("bft/") and not t.endswith("/q"))
    assert len(val_tags) == len(train_tags) + 2 > 10  # + Q of each layer
    assert sorted(t for t in ddp if t.startswith("bft_val/")) == val_tags
    for tag in val_tags:  # validation: 4 batches, 2 per rank, one reduce at epoch end
        # (Q is a parameter, equal on every rank: its histogram is over groups, not summed)
        (_, d), (_, s) = ddp[tag][-1], one[tag][-1]
        assert list(d.bucket) == list(s.bucket), tag
        assert (d.num, d.min, d.max) == (s.num, s.min, s.max), tag
        assert d.sum == pytest.approx(s.sum, rel=1e-9, abs=1e-9), tag
    for tag in train_tags:  # training: one batch per rank at step 0 == one process, steps 0 + 1
        ((step, d),) = ddp[tag]
        (_, s0), (_, s1) = one[tag]
        assert step == 0
        assert list(d.bucket) == [a + b for a, b in zip(s0.bucket, s1.bucket)], tag
        assert d.num == s0.num + s1.num and d.min == min(s0.min, s1.min), tag
        assert d.sum_squares == pytest.approx(s0.sum_squares + s1.sum_squares, rel=1e-9), tag


def nan_gain(ids):
    """Gain NaN wherever the item id is a multiple of 3."""
    gain = (ids.float() / 100).unsqueeze(-1).expand(-1, -1, 2).clone()
    gain[ids % 3 == 0] = float("nan")
    return {"gain": gain}


def nonfinite_counts(tmp_path, name: str, devices: int) -> dict:
    data = RankBatches([], make_batches(4, seed=20, length=12))
    monitor = PrecisionMonitor(log_on_validation=True, quantities=["gain"])
    logger = CSVLogger(str(tmp_path), name=name, version=0)
    opts = {**FAST, "devices": devices, "use_distributed_sampler": False, "logger": logger}
    if devices > 1:
        opts["strategy"] = "ddp_fork"
    Trainer(callbacks=[OneThread(), monitor], **opts).validate(ScriptedModule(nan_gain), data)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        (row,) = [r for r in csv.DictReader(f) if r.get("bft_val/blocks.0/gain/nonfinite")]
    return {k: float(v) for k, v in row.items() if k.startswith("bft_val/") and v}


def test_ddp_non_finite_counts_are_summed_over_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ddp = nonfinite_counts(tmp_path, "ddp", devices=2)
    one = nonfinite_counts(tmp_path, "one", devices=1)
    ids = [b["input_ids"] for b in make_batches(4, seed=20, length=12)]
    expected = 2 * sum(int(((x > 0) & (x % 3 == 0)).sum()) for x in ids)
    assert expected > 0
    assert ddp["bft_val/blocks.0/gain/nonfinite"] == one["bft_val/blocks.0/gain/nonfinite"]
    assert one["bft_val/blocks.0/gain/nonfinite"] == expected
    assert ddp == pytest.approx(one)


def sink_and_nan_gain(ids):
    """Sink mass 0.5 or 0.2 by the parity of the last item, and ``nan_gain``'s NaN gains."""
    valid = ids > 0
    rows = [sink_pattern(valid[i : i + 1], [0.5 if int(ids[i, -1]) % 2 else 0.2])
            for i in range(len(ids))]  # fmt: skip
    return {**nan_gain(ids), "attention": torch.cat(rows)}


def eval_metrics(tmp_path, name: str, devices: int) -> dict:
    batches = make_batches(4, seed=20, length=12)
    for b in batches:  # at least two valid keys per sequence
        b["input_ids"][:, -2:] = b["input_ids"][:, -2:].clamp_min(1)
    data = RankBatches([], batches, item_frequency=torch.arange(24.0))
    callbacks = [
        OneThread(),
        AttentionSinkMonitor(),
        GainByContextLength(bucket_edges=[1, 4], filename=None),
        GainByStratum(filename=None),
    ]
    logger = CSVLogger(str(tmp_path), name=name, version=0)
    opts = {**FAST, "devices": devices, "use_distributed_sampler": False, "logger": logger}
    if devices > 1:
        opts["strategy"] = "ddp_fork"
    Trainer(callbacks=callbacks, **opts).validate(ScriptedModule(sink_and_nan_gain), data)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {k: float(v) for r in rows for k, v in r.items() if v and k != "step"}


def test_ddp_sink_counts_and_eval_non_finite_counts_are_summed_over_ranks(tmp_path, monkeypatch):
    """The per-sequence sink counts and the left-out positions are summed across ranks."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ddp = eval_metrics(tmp_path, "ddp", devices=2)
    one = eval_metrics(tmp_path, "one", devices=1)
    ids = [b["input_ids"] for b in make_batches(4, seed=20, length=12)]
    for b in ids:
        b[:, -2:] = b[:, -2:].clamp_min(1)
    bad = sum(int(((x > 0) & (x % 3 == 0)).sum()) for x in ids)
    odd = torch.cat([x[:, -1] % 2 for x in ids]).double().mean().item()
    assert bad > 0 and 0 < odd < 1
    assert one["gain_ctx_val/blocks.0/nonfinite"] == one["stratum_val/blocks.0/nonfinite"] == bad
    assert one["sink_val/sink1"] == pytest.approx(odd)
    assert sorted(ddp) == sorted(one)
    assert ddp == pytest.approx(one)


class Samples(LightningDataModule):
    """One sample per row, batched by Lightning's own ``DistributedSampler`` under DDP:
    with 7 samples on 2 ranks, rank 1's last batch repeats sample 0."""

    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.rows = rows
        self.item_frequency = torch.arange(24.0)

    def val_dataloader(self) -> DataLoader:
        n = len(self.rows["input_ids"])
        items = [{k: v[i] for k, v in self.rows.items()} for i in range(n)]
        return DataLoader(items, batch_size=2)  # type: ignore[arg-type]


def sampler_metrics(tmp_path, name: str, devices: int, rows: dict) -> dict:
    callbacks = [
        OneThread(),
        PrecisionMonitor(log_on_validation=True, quantities=["gain", "n_eff"], histograms=False),
        AttentionSinkMonitor(),
        GainByContextLength(bucket_edges=[1, 4], filename=None),
        GainByStratum(filename=None),
    ]
    logger = CSVLogger(str(tmp_path), name=name, version=0)
    opts = {**FAST, "devices": devices, "logger": logger}  # Lightning's sampler
    if devices > 1:
        opts["strategy"] = "ddp_fork"
    Trainer(callbacks=callbacks, **opts).validate(ScriptedModule(sink_and_nan_gain), Samples(rows))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        return {k: float(v) for r in csv.DictReader(f) for k, v in r.items() if v and k != "step"}


def test_ddp_leaves_out_the_samples_distributed_sampler_repeats(tmp_path, monkeypatch):
    """With Lightning's DistributedSampler (7 samples, 2 ranks: one repeated to even
    out the ranks) every callback reports what one process reports over the 7."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = make_batch(batch_size=7, length=12, seed=30)
    rows["input_ids"][:, -2:] = rows["input_ids"][:, -2:].clamp_min(1)
    rows["input_ids"][0] = 3  # sample 0 (the repeated one) has many NaN gains (3 | id)
    one = sampler_metrics(tmp_path, "one", 1, rows)
    ddp = sampler_metrics(tmp_path, "ddp", 2, rows)
    ids = rows["input_ids"]
    assert one["stratum_val/blocks.0/nonfinite"] == int(((ids > 0) & (ids % 3 == 0)).sum()) > 12
    assert sorted(ddp) == sorted(one)
    assert ddp == pytest.approx(one)
