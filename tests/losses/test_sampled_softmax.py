"""The shared-negative sampled softmax: the log-Q correction, accidental hits, sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bft_lightning.losses import SampledSoftmax
from bft_lightning.models import BERT4Rec, SASRec


def _zipf(num_items: int, a: float = 1.2) -> torch.Tensor:
    freq = torch.zeros(num_items + 1, dtype=torch.float64)
    freq[1:] = 1000.0 * torch.arange(1, num_items + 1, dtype=torch.float64) ** -a
    return freq


def test_log_q_brings_the_expected_gradient_to_the_full_softmax() -> None:
    """Monte Carlo over many batches on a small catalogue: targets drawn by popularity,
    popularity-sampled negatives. The mean gradient of the corrected loss is far
    nearer the mean full-softmax gradient (same targets) than the uncorrected
    loss's, which pushes popular items down too hard."""
    torch.manual_seed(0)
    num_items, n, d, k, draws = 100, 32, 8, 32, 200
    model = SASRec(num_items, 8, d_model=d)
    with torch.no_grad():
        model.item_emb.weight.normal_(std=0.5)
    freq = _zipf(num_items, 1.0)
    hidden = torch.randn(n, d, requires_grad=True)
    wrt = (hidden, model.item_emb.weight)

    def flat(value: torch.Tensor) -> torch.Tensor:
        return torch.cat([g.flatten() for g in torch.autograd.grad(value, wrt)])

    # the full softmax's gradient averaged over targets t ~ p: that of
    # mean_r [logsumexp_r(z) - sum_i p_i z_ri] (the loss is linear in the one-hot)
    p = (freq / freq.sum()).float()
    logits = model.score(hidden, None)
    full = flat((torch.logsumexp(logits, 1) - (logits[:, 1:] * p[1:]).sum(1)).mean())
    errors = {}
    for logq in (True, False):
        loss = SampledSoftmax(num_items, k, "popularity", logq=logq)
        loss.set_item_frequency(freq)
        torch.manual_seed(1)
        sampled = torch.zeros_like(full)
        for _ in range(draws):
            target = torch.multinomial(freq.float(), n, replacement=True)
            sampled += flat(loss(model, hidden, target, None))
        errors[logq] = float((sampled / draws - full).norm() / full.norm())
    assert errors[True] < 0.5 * errors[False], errors


def _manual(model, hidden, target, sampled, freq, k, temperature=1.0, logq=True, mask=True):
    """The loss written out one row and one candidate at a time."""
    cand = torch.cat([target, sampled])
    q = freq.pow(1.0) / freq.sum()
    p = freq / freq.sum()
    rows = []
    for r in range(len(target)):
        logits = []
        for j, item in enumerate(cand.tolist()):
            z = float(hidden[r] @ model.item_emb.weight[item].detach()) / temperature
            if logq:
                z -= float(torch.log(len(target) * p[item] + k * q[item]))
            if mask and item == int(target[r]) and j != r:
                z = float("-inf")
            logits.append(z)
        rows.append(-torch.log_softmax(torch.tensor(logits, dtype=torch.float64), 0)[r])
    return torch.stack(rows).mean()


def test_matches_the_written_out_loss_and_masks_accidental_hits(monkeypatch) -> None:
    torch.manual_seed(0)
    num_items = 12
    model = SASRec(num_items, 8, d_model=4)
    freq = _zipf(num_items)
    hidden = torch.randn(4, 4)
    target = torch.tensor([5, 5, 7, 2])  # rows 0 and 1 share a target: each a hit of the other
    sampled = torch.tensor([7, 9, 5])  # accidental hits of rows 0, 1 and 2
    loss = SampledSoftmax(num_items, 3, "popularity", temperature=0.5)
    loss.set_item_frequency(freq)
    monkeypatch.setattr(loss, "sample", lambda k, device: sampled)
    got = loss(model, hidden, target, None).double()
    want = _manual(model, hidden, target, sampled, freq, 3, temperature=0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    unmasked = _manual(model, hidden, target, sampled, freq, 3, temperature=0.5, mask=False)
    assert abs(float(unmasked - want)) > 1e-2  # the mask matters here
    uncorrected = _manual(model, hidden, target, sampled, freq, 3, temperature=0.5, logq=False)
    assert abs(float(uncorrected - want)) > 1e-2


def test_accidental_hit_gets_no_gradient(monkeypatch) -> None:
    """A sampled copy of the row's target is masked: the loss is that of the other
    candidates, and the target's embedding moves only as the positive."""
    torch.manual_seed(0)
    model = SASRec(10, 8, d_model=4)
    hidden, target = torch.randn(1, 4), torch.tensor([3])
    loss = SampledSoftmax(10, 2, "uniform", logq=False)
    monkeypatch.setattr(loss, "sample", lambda k, device: torch.tensor([3, 6]))
    with_hit = loss(model, hidden, target, None)
    w = model.item_emb.weight
    want = F.cross_entropy((hidden @ w[[3, 6]].t()), torch.tensor([0]))
    torch.testing.assert_close(with_hit, want)


@pytest.mark.parametrize("negatives", ["uniform", "popularity"])
def test_sampler_follows_its_proposal(negatives: str) -> None:
    torch.manual_seed(0)
    num_items = 20
    loss = SampledSoftmax(num_items, 5, negatives, alpha=0.5)
    freq = _zipf(num_items)
    freq[4] = 0.0  # never seen in training: never drawn by popularity
    loss.set_item_frequency(freq)
    draws = loss.sample(200_000, torch.device("cpu"))
    assert int(draws.min()) >= 1 and int(draws.max()) <= num_items
    counts = torch.bincount(draws, minlength=num_items + 1).double() / len(draws)
    q = loss.proposal(torch.device("cpu"))
    assert float(q.sum()) == pytest.approx(1.0) and float(q[0]) == 0.0
    torch.testing.assert_close(counts, q, atol=4e-3, rtol=0)
    if negatives == "popularity":
        assert counts[4] == 0
        torch.testing.assert_close(q[1] / q[4 + 1], (freq[1] / freq[5]) ** 0.5)


def test_in_batch_without_frequency_uses_batch_counts() -> None:
    """No item counts: the in-batch candidates' expected count is the batch's own count;
    popularity sampling then says what is missing."""
    torch.manual_seed(0)
    model = SASRec(10, 8, d_model=4)
    hidden, target = torch.randn(3, 4), torch.tensor([2, 2, 5])
    loss = SampledSoftmax(10, 1, "in_batch")
    got = loss(model, hidden, target, None)
    logits = hidden @ model.item_emb.weight[target].t() - torch.log(torch.tensor([2.0, 2, 1]))
    logits[0, 1] = logits[1, 0] = float("-inf")
    torch.testing.assert_close(got, F.cross_entropy(logits, torch.arange(3)))
    with pytest.raises(ValueError, match="negatives='popularity'.*none was given"):
        SampledSoftmax(10, 4, "popularity")(model, hidden, target, None)
    with pytest.raises(ValueError, match="item_frequency has 5 entries, need num_items"):
        loss.set_item_frequency(torch.ones(5))


def test_bias_and_precision_head_are_used() -> None:
    """The shared candidates are scored by the model's own head: the BERT4Rec bias and
    the precision head's temperature, as ``model.score`` scores them."""
    torch.manual_seed(0)
    for model in (
        BERT4Rec(15, 8, d_model=8),
        SASRec(15, 8, d_model=8, precision="on", head="precision"),
    ):
        with torch.no_grad():
            if hasattr(model, "out_bias"):
                model.out_bias.normal_()
            if hasattr(model, "temperature"):
                model.temperature.weight.normal_()
                model.temperature.bias.normal_()
        hidden = torch.randn(3, 8)
        lp = torch.randn(3, model.groups) if model.precision == "on" else None
        target = torch.tensor([1, 4, 9])
        loss = SampledSoftmax(15, 1, "in_batch", logq=False)
        got = loss(model, hidden, target, lp)
        logits = model.score(hidden, lp, items=target.expand(3, 3))
        torch.testing.assert_close(got, F.cross_entropy(logits, torch.arange(3)))
