"""HSTU recommender: shapes of encode / last_hidden / score, timestamps, a tiny fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bft_lightning.models.hstu import HSTU
from bft_lightning.nn.hstu import HSTULayer

NUM_ITEMS, L, D = 50, 10, 16


def model(precision: str, **kw) -> HSTU:
    return HSTU(num_items=NUM_ITEMS, max_len=L, d_model=D, nhead=2, num_layers=2,
                precision=precision, **kw)  # fmt: skip


def batch(b: int = 4, timed: bool = True) -> dict[str, torch.Tensor]:
    seq = torch.randint(1, NUM_ITEMS + 1, (b, L + 1))
    seq[0, :6] = 0  # left padding
    seq[1, :-1] = 0  # a one-item history
    out = {"seq": seq}
    if timed:
        times = 1_600_000_000 + (10 ** (torch.rand(b, L + 1) * 6)).long().cumsum(1)
        out["seq_time"] = times * (seq != 0)
    return out


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("precision", ["off", "on"])
def test_shapes_with_and_without_timestamps(precision: str, timed: bool) -> None:
    m = model(precision).eval()
    assert all(isinstance(layer, HSTULayer) for layer in m.encoder.layers)
    ids, labels, times = m.train_view(batch(timed=timed))
    assert ids.shape == labels.shape == (4, L) and (times is not None) == timed
    hidden, lp = m.encode(ids, times)
    assert hidden.shape == (4, L, D) and torch.isfinite(hidden).all()
    if precision == "on":
        assert lp.shape == (4, L, 2) and torch.isneginf(lp[ids == 0]).all()
    else:
        assert lp is None
    scores = m.score(hidden, lp)
    assert scores.shape == (4, L, NUM_ITEMS + 1) and torch.isneginf(scores[..., 0]).all()
    last, last_lp = m.last_hidden(ids, times)
    assert last.shape == (4, D)
    torch.testing.assert_close(last, hidden[:, -1])
    assert (last_lp is None) == (precision == "off")


@pytest.mark.parametrize("precision", ["off", "on"])
def test_timestamps_feed_the_time_bias(precision: str) -> None:
    m = model(precision).eval()
    with torch.no_grad():
        for layer in m.encoder.layers:
            layer.rab.time_weight.normal_(0.0, 1.0)
    ids, _, times = m.train_view(batch())
    h_none, _ = m.encode(ids)
    h_time, _ = m.encode(ids, times)
    assert not torch.allclose(h_none, h_time)
    # shifting every timestamp by a constant changes nothing (only gaps matter)
    torch.testing.assert_close(m.encode(ids, times + 12345)[0], h_time)


def test_options_and_gate_rejected() -> None:
    m = model("on", linear_dim=4, attention_dim=6, num_buckets=16)
    layer = m.encoder.layers[0]
    assert (layer.dv, layer.dqk, layer.rab.num_buckets, layer.max_len) == (4, 6, 16, L)
    assert m.encoder.layers[-1].predict_noise is False  # dot head: last Q feeds nothing
    with pytest.raises(ValueError, match="attention_gate"):
        model("off", attention_gate="sigmoid")


@pytest.mark.parametrize("precision", ["off", "on"])
def test_tiny_fit_lowers_the_loss_and_trains_tau(precision: str) -> None:
    m = model(precision, dropout=0.0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    data = batch(8)
    losses = []
    for _ in range(30):
        ids, labels, times = m.train_view(data)
        hidden, lp = m.encode(ids, times)
        logits = m.score(hidden, lp)
        loss = F.cross_entropy(logits[labels > 0], labels[labels > 0])
        opt.zero_grad()
        loss.backward()
        if precision == "on" and not losses:
            assert m.prior.log_tau.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
