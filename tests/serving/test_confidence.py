"""Recommendation confidence: the AUROC it is judged by, its definition's properties,
and that it separates predictable users from unpredictable ones after training."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from bft_lightning.metrics.confidence import auroc, hit_rate_by_decile
from bft_lightning.models import HSTU, SASRec
from bft_lightning.nn.stats import set_recording
from bft_lightning.retrieval import TopK
from bft_lightning.serving.confidence import (
    gaussian_list_log_prob,
    last_position_gain,
    normalised_log_precision,
    normalised_score_variance,
    plackett_luce_log_prob,
    recommendation_confidence,
    softmax_mass,
)

N_ITEMS, L = 30, 8


def _brute_auroc(conf: list[float], hit: list[bool]) -> float:
    pos = [c for c, h in zip(conf, hit, strict=True) if h]
    neg = [c for c, h in zip(conf, hit, strict=True) if not h]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("levels", [3, 1000])  # many ties, few ties
def test_auroc_matches_pairwise_count(levels: int) -> None:
    g = torch.Generator().manual_seed(levels)
    for _ in range(5):
        conf = torch.randint(0, levels, (200,), generator=g).float()
        hit = torch.rand(200, generator=g) < 0.3
        assert auroc(conf, hit) == pytest.approx(_brute_auroc(conf.tolist(), hit.tolist()))


def test_auroc_edge_cases() -> None:
    hit = torch.tensor([0, 1, 0, 1, 1], dtype=torch.bool)
    assert auroc(torch.ones(5), hit) == 0.5  # constant: chance
    assert auroc(hit.float(), hit) == 1.0
    assert auroc(-hit.float(), hit) == 0.0
    assert math.isnan(auroc(torch.arange(5.0), torch.zeros(5, dtype=torch.bool)))
    with pytest.raises(ValueError, match="NaN"):
        auroc(torch.tensor([0.0, float("nan")]), torch.tensor([True, False]))


def test_hit_rate_by_decile() -> None:
    conf = torch.arange(100.0)
    hit = (conf >= 90).float()  # only the top decile hits
    rates = hit_rate_by_decile(conf.flip(0), hit.flip(0))
    assert rates == [0.0] * 9 + [1.0]
    assert sum(hit_rate_by_decile(torch.rand(103), torch.ones(103))) == 10.0


def _top(scores: torch.Tensor, k: int) -> TopK:
    s = scores.clone()
    s[:, 0] = float("-inf")
    v, i = torch.topk(s, k, dim=1)
    return TopK(scores=v, ids=i, logsumexp=torch.logsumexp(s, 1))


def test_softmax_mass_and_list_probability_match_brute_force() -> None:
    scores = torch.randn(4, 12)
    top = _top(scores, 3)
    p = F.softmax(scores[:, 1:], dim=1)  # column 0 is padding
    mass = p.topk(3, dim=1).values.sum(1)
    torch.testing.assert_close(softmax_mass(top), mass)
    # Plackett-Luce: draw the three, in order, without replacement
    pv = p.topk(3, dim=1).values
    pl = pv[:, 0] * pv[:, 1] / (1 - pv[:, 0]) * pv[:, 2] / (1 - pv[:, 0] - pv[:, 1])
    torch.testing.assert_close(plackett_luce_log_prob(top).exp(), pl)
    # Gaussian list probability: wider scores, a less certain order
    mean = top.scores
    assert bool((gaussian_list_log_prob(mean, torch.ones_like(mean)) <
                 gaussian_list_log_prob(mean, 0.1 * torch.ones_like(mean))).all())  # fmt: skip


def _model(kind: str, precision: str) -> torch.nn.Module:
    cls = SASRec if kind == "sasrec" else HSTU
    m = cls(N_ITEMS, max_len=L, d_model=16, nhead=2, num_layers=2, precision=precision,
            dropout=0.0)  # fmt: skip
    return m.eval()


def _confidence(model: torch.nn.Module, ids: torch.Tensor, k: int = 5) -> torch.Tensor:
    set_recording(model, True)
    with torch.no_grad():
        hidden, lp, scale = model.last_encoded(ids)
        top = _top(model.score(hidden, lp), k)
        out = recommendation_confidence(model, hidden, lp, top, scale)
    set_recording(model, False)
    return out


def _ids(n: int = 6) -> torch.Tensor:
    ids = torch.randint(1, N_ITEMS + 1, (n, L))
    ids[0, :5] = 0  # a short, left-padded history
    return ids


@pytest.mark.parametrize("kind", ["sasrec", "hstu"])
@pytest.mark.parametrize("precision", ["off", "on"])
def test_confidence_shape_dtype_and_batch_permutation(kind: str, precision: str) -> None:
    model, ids = _model(kind, precision), _ids()
    conf = _confidence(model, ids)
    assert conf.shape == (len(ids),) and conf.dtype == torch.float32
    assert bool(torch.isfinite(conf).all())
    perm = torch.randperm(len(ids))
    torch.testing.assert_close(_confidence(model, ids[perm]), conf[perm], rtol=1e-4, atol=1e-5)


def test_off_confidence_is_the_softmax_mass() -> None:
    model, ids = _model("sasrec", "off"), _ids()
    with torch.no_grad():
        hidden, lp = model.last_hidden(ids)
        scores = model.score(hidden, lp)
    top = _top(scores, 5)
    torch.testing.assert_close(recommendation_confidence(model, hidden, lp, top), softmax_mass(top))


@pytest.mark.parametrize("kind", ["sasrec", "hstu"])
def test_on_confidence_is_the_precision_of_the_scored_state(kind: str) -> None:
    """mean_g log lambda_g + 2 log sigma, sigma the final norm's divisor at the predicting
    position; and the filter's score variance, sum_g |gamma e_g|^2 / (lambda_g sigma^2)."""
    model, ids = _model(kind, "on"), _ids()
    with torch.no_grad():  # a non-trivial norm scale, so that it matters
        model.final_norm.weight.uniform_(0.5, 2.0)
    seen = {}
    hook = model.final_norm.register_forward_pre_hook(lambda m, a: seen.update(h=a[0][:, -1]))
    set_recording(model, True)
    with torch.no_grad():
        hidden, lp, scale = model.last_encoded(ids)
        top = _top(model.score(hidden, lp), 5)
    hook.remove()
    assert lp is not None
    sigma2 = seen["h"].var(-1, unbiased=False) + model.final_norm.eps
    emb = model.item_emb(top.ids) * model.final_norm.weight  # (N, k, d)
    per_group = emb.reshape(*emb.shape[:2], 2, -1).square().sum(-1)  # 2 groups
    var = (per_group / lp.exp().unsqueeze(1)).sum(-1) / sigma2.unsqueeze(1)
    torch.testing.assert_close(normalised_score_variance(model, lp, top.ids, scale), var)
    conf = recommendation_confidence(model, hidden, lp, top, scale)
    torch.testing.assert_close(conf, lp.mean(-1) + sigma2.log())
    torch.testing.assert_close(normalised_log_precision(lp, scale), conf)
    higher = recommendation_confidence(model, hidden, lp + 1.0, top, scale)  # all else equal
    torch.testing.assert_close(higher, conf + 1.0)
    set_recording(model, False)


def test_gain_is_read_at_the_predicting_position() -> None:
    model, ids = _model("hstu", "on"), _ids()
    set_recording(model, True)
    with torch.no_grad():
        model.last_hidden(ids)
    gain = last_position_gain(model)
    set_recording(model, False)
    assert gain is not None and gain.shape == (len(ids),)
    assert bool(((gain > 0) & (gain < 1)).all())


def test_trained_confidence_is_higher_for_predictable_users() -> None:
    """Half the users walk the item cycle 1, 2, ..., 20 (their next item is
    determined), half draw items at random; after a short training the
    predictable users get the higher confidence (the off model's softmax mass;
    the on model's final precision does not separate them on this toy, see
    docs/confidence.md)."""
    torch.manual_seed(0)
    n_items = 20
    model = SASRec(n_items, max_len=L, d_model=16, nhead=2, num_layers=1, precision="off",
                   dropout=0.0)  # fmt: skip

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, n_items, (n, 1))
        walk = (start + torch.arange(L + 1)) % n_items + 1
        noise = torch.randint(1, n_items + 1, (n, L + 1))
        seq = torch.cat([walk, noise])
        return seq, torch.cat([torch.ones(n), torch.zeros(n)]).bool()

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        seq, _ = batch(32)
        h, _ = model.encode(seq[:, :-1])
        loss = F.cross_entropy(model.score(h.reshape(-1, 16)), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    seq, predictable = batch(100)
    conf = _confidence(model, seq[:, :-1], k=3)
    assert auroc(conf, predictable) > 0.8
