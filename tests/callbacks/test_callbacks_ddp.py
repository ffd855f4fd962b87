"""Under 2-process CPU DDP the logged histograms equal those of one process on the same data.

The data module gives rank ``r`` of ``w`` the batches ``r::w``, so both runs see
the same batches. The model is frozen (``lr=0``, no running sill update, no
dropout), so the single-process run, which sees the two training batches in
two steps, measures the same weights as the DDP run does in one step.
"""

import csv

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tb_events import read_events
from toy_bft import FAST, OneThread, RankBatches, ScriptedModule, ToyBFT, make_batches

from bft_lightning.callbacks import PrecisionMonitor

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
