"""Sink mass: constructed attention patterns with known alpha_1 and Sink_1."""

import math

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from toy_bft import FAST, ScriptedModule, ToyBFT, loader, make_batches

from bft_lightning.callbacks import AttentionSinkMonitor
from bft_lightning.callbacks.attention_sink import first_valid_index, sink_alpha, sink_rate

pytestmark = pytest.mark.filterwarnings("ignore:.*(val_dataloader|LeafSpec|logging interval).*")


def sink_pattern(valid: torch.Tensor, alphas: list[float]) -> torch.Tensor:
    """Bidirectional weights: each valid query puts alpha_h on the first valid key, the
    rest spread evenly over the other valid keys (weight 1 when it is the only one)."""
    b, t = valid.shape
    first = first_valid_index(valid)
    n = valid.sum(1).view(b, 1, 1, 1).float()
    a = torch.tensor(alphas).view(1, -1, 1, 1)
    rest = ((1 - a) / (n - 1).clamp_min(1)).expand(b, len(alphas), t, t).clone()
    att = rest * valid[:, None, None, :]
    is_first = torch.zeros(b, 1, 1, t).scatter_(-1, first.view(b, 1, 1, 1), 1.0)
    att = torch.where(is_first.bool(), torch.where(n > 1, a, 1.0), att)
    return att * valid[:, None, :, None]


def test_sink_alpha_of_a_constructed_pattern():
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    att = sink_pattern(valid, [0.6, 0.1])
    rows = att.sum(-1)  # (B, H, T): 1 for valid queries, 0 for padding
    assert torch.allclose(rows, valid[:, None, :].expand_as(rows).float())
    alpha, has = sink_alpha(att, valid)
    expected = torch.tensor([[0.6, 0.1], [0.6, 0.1], [1.0, 1.0]])  # one key: all on it
    assert torch.allclose(alpha, expected) and has.all()


def test_sink_alpha_of_causal_uniform_attention_is_the_mean_of_one_over_i():
    t = 6
    att = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1).view(t, 1)
    alpha, _ = sink_alpha(att.view(1, 1, t, t), torch.ones(1, t, dtype=torch.bool))
    assert alpha.item() == pytest.approx(sum(1 / i for i in range(1, t + 1)) / t)


def test_sink_rate_is_the_fraction_of_sequence_head_pairs_above_eps():
    above = torch.tensor([[3.0, 0.0, 1.0], [2.0, 4.0, 0.0], [0.0, 0.0, 0.0]])
    count = torch.tensor([[4.0, 4.0, 4.0], [4.0, 4.0, 0.0], [0.0, 0.0, 0.0]])
    rate = sink_rate(above, count)
    assert rate[:2].tolist() == pytest.approx([4 / 12, 6 / 8]) and math.isnan(rate[2])


@pytest.mark.filterwarnings("ignore:.*no logger")
def test_sink1_thresholds_each_sequence_before_averaging():
    """Gu et al. 2025 compare each sequence's alpha_1 with eps, then average: sequences at
    0.5 and 0.2 make half a sink (thresholding their mean, 0.35, would make a whole one)."""

    def alternating(ids):
        valid = ids > 0
        rows = [sink_pattern(valid[i : i + 1], [0.5, 0.6] if i % 2 else [0.2, 0.6])
                for i in range(len(ids))]  # fmt: skip
        return {"attention": torch.cat(rows)}

    batches = make_batches(2, length=8)
    for b in batches:
        b["input_ids"][:, -2:] = b["input_ids"][:, -2:].clamp_min(1)
    monitor = AttentionSinkMonitor(eps=0.3)
    Trainer(callbacks=[monitor], **FAST).validate(ScriptedModule(alternating), loader(batches))
    assert monitor.last_alpha1[0].tolist() == pytest.approx([0.35, 0.6])
    assert monitor.last_sink1.tolist() == [0.75]  # head 0: half the sequences; head 1: all
    assert monitor.last_summary["sink_val/blocks.0/sink1"] == 0.75
    assert monitor.last_summary["sink_val/sink1"] == 0.75


def test_monitor_measures_the_constructed_pattern(tmp_path):
    def head_pattern(alphas):
        return lambda ids: {"attention": sink_pattern(ids > 0, alphas)}

    model = ScriptedModule(head_pattern([0.6, 0.1]), head_pattern([0.2, 0.2]))
    batches = make_batches(3, length=8)
    for b in batches:  # at least two valid keys per sequence
        b["input_ids"][:, -2:] = b["input_ids"][:, -2:].clamp_min(1)
    monitor = AttentionSinkMonitor(eps=0.3)
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    Trainer(callbacks=[monitor], **{**FAST, "logger": logger}).validate(model, loader(batches))
    assert torch.allclose(monitor.last_alpha1, torch.tensor([[0.6, 0.1], [0.2, 0.2]]).double())
    assert monitor.last_sink1.tolist() == [0.5, 0.0]
    s = monitor.last_summary
    assert s["sink_val/blocks.0/alpha1/h0"] == pytest.approx(0.6)
    assert s["sink_val/blocks.0/sink1"] == 0.5 and s["sink_val/sink1"] == 0.25
    assert s["sink_val/alpha1"] == pytest.approx((0.6 + 0.1 + 0.2 + 0.2) / 4)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        assert "sink_val/blocks.1/alpha1/h1" in f.readline()


@pytest.mark.parametrize("precision", ["on", "off"])
def test_monitor_runs_with_and_without_bft(tmp_path, precision):
    monitor = AttentionSinkMonitor(stages=["test"], max_batches=1)
    trainer = Trainer(callbacks=[monitor], **{**FAST, "default_root_dir": str(tmp_path)})
    with pytest.warns(UserWarning, match="no logger"):
        trainer.test(ToyBFT(precision=precision), loader(make_batches(2)))
    assert monitor.last_alpha1 is not None and monitor.last_alpha1.shape == (2, 2)
    assert ((monitor.last_alpha1 > 0) & (monitor.last_alpha1 <= 1)).all()
    assert "sink_test/encoder.layers.1/sink1" in monitor.last_summary
