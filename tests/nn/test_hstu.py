"""HSTULayer / HSTUEncoder: reduction to a plain HSTU written here; docs/spec.md properties."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from bft_lightning.nn import PrecisionPrior, set_recording
from bft_lightning.nn import jacobian as J
from bft_lightning.nn.filter import FILTER_FIELDS, FilterConfig
from bft_lightning.nn.hstu import (
    HSTUEncoder,
    HSTULayer,
    relative_reliability,
    sandwich_variance,
    time_buckets,
)

D, H, N = 16, 2, 24  # width, heads, max_len (the divisor N)


def hstu_layer(**kw) -> HSTULayer:
    opts = dict(d_model=D, nhead=H, max_len=N, dropout=0.0)
    opts.update(kw)
    config = FilterConfig(**{k: opts.pop(k) for k in list(opts) if k in FILTER_FIELDS})
    return HSTULayer(**opts, config=config)


def stamps(b: int, t: int) -> torch.Tensor:
    """Increasing unix-like seconds with gaps from seconds to months."""
    gaps = (10 ** (torch.rand(b, t) * 7)).long()
    return 1_600_000_000 + gaps.cumsum(dim=1)


def plain_hstu(layer: HSTULayer, x, valid, ts=None) -> torch.Tensor:
    """HSTU as the generative-recommenders reference writes it (padded, not jagged)."""
    b, n, _ = x.shape
    nh, dv, dqk, big_n = layer.nhead, layer.dv, layer.dqk, layer.max_len
    mm = F.silu(F.layer_norm(x, [D], eps=1e-6) @ layer.uvqk.weight.t())
    u, v, q, k = torch.split(mm, [dv * nh, dv * nh, dqk * nh, dqk * nh], dim=-1)
    qk = torch.einsum("bnhd,bmhd->bhnm", q.view(b, n, nh, dqk), k.view(b, n, nh, dqk))
    # relative position bias by the reference's pad-and-repeat construction
    t = F.pad(layer.rab.pos_weight[: 2 * big_n - 1], [0, big_n]).repeat(big_n)
    t = t[..., :-big_n].reshape(1, big_n, 3 * big_n - 2)
    r = (2 * big_n - 1) // 2
    bias = t[:, :, r:-r][:, :n, :n]
    if ts is not None:
        dt = ts.unsqueeze(2) - ts.unsqueeze(1)
        buckets = (torch.log(dt.abs().clamp(min=1)) / 0.301).long().clamp(0, layer.rab.num_buckets)
        bias = bias + layer.rab.time_weight[buckets]
    attn = F.silu(qk + bias.unsqueeze(1)) / big_n
    mask = torch.ones(n, n).tril().bool() & valid[:, None, :]  # causal, padding keys excluded
    attn = attn * mask.unsqueeze(1)
    out = torch.einsum("bhnm,bmhd->bnhd", attn, v.view(b, n, nh, dv)).reshape(b, n, nh * dv)
    return layer.out_proj(u * F.layer_norm(out, [nh * dv], eps=1e-6)) + x


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("dims", [(None, None), (3, 5)])
def test_off_equals_plain_hstu(timed: bool, dims: tuple) -> None:
    layer = hstu_layer(precision="off", linear_dim=dims[0], attention_dim=dims[1]).eval()
    with torch.no_grad():  # make Q.K and the biases matter
        layer.uvqk.weight.normal_(0.0, 0.3)
        layer.rab.pos_weight.normal_(0.0, 0.5)
        layer.rab.time_weight.normal_(0.0, 0.5)
    x, ts = torch.randn(3, 9, D), stamps(3, 9)
    pad = torch.arange(9).expand(3, 9) < torch.tensor([[0], [3], [8]])  # left padding
    got, lp = layer(x, key_padding_mask=pad, timestamps=ts if timed else None)
    expected = plain_hstu(layer, x, ~pad, ts if timed else None)
    assert lp is None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_helpers() -> None:
    a = torch.linspace(-6, 6, 50, requires_grad=True)
    (grad,) = torch.autograd.grad(F.silu(a).sum(), a)
    torch.testing.assert_close(J.silu_derivative(a), grad)
    ts = torch.tensor([[0, 1, 3, 1000, 10**9]])
    b = time_buckets(ts, num_buckets=60)
    assert b[0, 0, 1] == 0 and b[0, 0, 2] == 3 and b[0, 3, 0] == 22 and b[0, 4, 0] == 60
    assert torch.equal(b, b.transpose(1, 2))


def test_relative_reliability_uniform_is_one_and_mean_is_causal() -> None:
    allowed = torch.ones(4, 4, dtype=torch.bool).tril().expand(1, 1, 4, 4)
    r = relative_reliability(torch.full((1, H, 4), 3.7), allowed)
    torch.testing.assert_close(r, allowed.expand(1, H, 4, 4).float())
    lb = torch.randn(1, H, 4)
    r = relative_reliability(lb, allowed)
    # row t: lambda_bar_j / mean_{j' <= t} lambda_bar_j'
    lam = lb.exp()
    expected = lam.unsqueeze(-2) / (lam.cumsum(-1) / torch.arange(1, 5)).unsqueeze(-1)
    torch.testing.assert_close(r, expected * allowed)


def test_sandwich_expanded_square_equals_explicit_sum() -> None:
    b, h, t, dv = 2, 3, 6, 4
    w = torch.randn(b, h, t, t, dtype=torch.float64) * 0.3  # signed, like SiLU weights
    v = torch.randn(b, h, t, dv, dtype=torch.float64) + 2.0
    w2 = w.square()
    s0, s1 = w2.sum(-1), w2 @ v
    s2 = w2 @ v.square().mean(-1, keepdim=True)
    for centre in (s1 / s0.unsqueeze(-1), torch.randn(b, h, t, dv, dtype=torch.float64)):
        explicit = (w2 * (v.unsqueeze(2) - centre.unsqueeze(3)).square().mean(-1)).sum(-1)
        got = sandwich_variance(s0, s1, s2.squeeze(-1), centre)
        torch.testing.assert_close(got, explicit, rtol=1e-9, atol=1e-12)
    # positive weights: the w-weighted mean as centre also works
    wp = w.abs()
    wp2 = wp.square()
    ebar = (wp @ v) / wp.sum(-1, keepdim=True)
    explicit = (wp2 * (v.unsqueeze(2) - ebar.unsqueeze(3)).square().mean(-1)).sum(-1)
    s2p = (wp2 @ v.square().mean(-1, keepdim=True)).squeeze(-1)
    got = sandwich_variance(wp2.sum(-1), wp2 @ v, s2p, ebar)
    torch.testing.assert_close(got, explicit, rtol=1e-9, atol=1e-12)


def uniform_log_prec(layer: HSTULayer, x: torch.Tensor, log_c: float) -> torch.Tensor:
    """One head, one group: the lambda that makes lambda_bar = c at every key.

    ``1 / lambda_bar_j = mean_c SiLU'(a_jc)^2 sum_k W_V[c, k]^2 / (lambda_j sigma_j^2)``.
    """
    a = (F.layer_norm(x, [D], eps=1e-6) @ layer.value_weight.t()).requires_grad_()
    (dsilu,) = torch.autograd.grad(F.silu(a).sum(), a)
    row = layer.value_weight.square().sum(-1)  # (dv,)
    sigma2 = x.var(-1, unbiased=False) + 1e-6
    return (log_c + torch.log((dsilu.square() * row).mean(-1)) - torch.log(sigma2)).unsqueeze(-1)


def test_uniform_precision_gives_hstu() -> None:
    off = hstu_layer(nhead=1, groups=1, precision="off").eval()
    on = hstu_layer(nhead=1, groups=1, precision="on").eval()
    on.load_state_dict(off.state_dict(), strict=False)
    x = torch.randn(2, 8, D) * torch.rand(2, 8, 1) * 3  # tokens of different scales
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, :3] = True
    set_recording(off, True, attention=True)
    set_recording(on, True, attention=True)
    y_off, _ = off(x, key_padding_mask=pad)
    on(x, uniform_log_prec(on, x, 0.0), key_padding_mask=pad)
    torch.testing.assert_close(on.last_stats.attention, off.last_stats.attention)
    # a uniformly tiny prior precision: K -> 1, so the layer is plain HSTU
    lp = uniform_log_prec(on, x, -10.0)
    assert lp.min() > -20  # inside the clamp
    y_on, _ = on(x, lp, key_padding_mask=pad)
    assert (on.last_stats.gain[~pad] > 1 - 1e-4).all()
    torch.testing.assert_close(y_on[~pad], y_off[~pad], rtol=1e-4, atol=1e-4)
    # and a non-uniform precision does change the weights
    on(x, lp + torch.randn_like(lp), key_padding_mask=pad)
    assert not torch.allclose(on.last_stats.attention, off.last_stats.attention)


def _run_layers(enc: HSTUEncoder, x, lp, pad, ts):
    outs, h = [], x
    for layer in enc.layers:
        h, lp = layer(h, lp, key_padding_mask=pad, timestamps=ts)
        outs.append((h, lp))
    return outs


@pytest.mark.parametrize("precision", ["off", "on"])
def test_left_padding_invariance_every_layer(precision: str) -> None:
    enc = HSTUEncoder(hstu_layer(precision=precision, groups=4), num_layers=3).eval()
    t, n_pad = 7, 4
    x, lp, ts = torch.randn(1, t, D), torch.randn(1, t, 4), stamps(1, t)
    xp = torch.cat([torch.randn(1, n_pad, D) * 100, x], 1)
    lpp = torch.cat([torch.randn(1, n_pad, 4), lp], 1)
    tsp = torch.cat([torch.zeros(1, n_pad, dtype=torch.long), ts], 1)
    pad = torch.arange(t + n_pad).unsqueeze(0) < n_pad
    ref = _run_layers(enc, x, lp, None, ts)
    got = _run_layers(enc, xp, lpp, pad, tsp)
    for (h0, lp0), (h1, lp1) in zip(ref, got):
        torch.testing.assert_close(h1[:, n_pad:], h0, rtol=1e-4, atol=1e-5)
        if precision == "on":
            torch.testing.assert_close(lp1[:, n_pad:], lp0, rtol=1e-4, atol=1e-5)
            assert torch.isneginf(lp1[pad]).all()  # precision 0 stays absorbing


@pytest.mark.parametrize("train", [False, True])
def test_causality(train: bool) -> None:
    enc = HSTUEncoder(hstu_layer(precision="on"), num_layers=2).train(train)
    x, lp, ts = torch.randn(2, 8, D), torch.randn(2, 8, H), stamps(2, 8)
    x2, lp2, ts2 = x.clone(), lp.clone(), ts.clone()
    x2[:, 5] += 10.0
    lp2[:, 5] -= 3.0
    ts2[:, 5:] += 10**6
    y1, p1 = copy.deepcopy(enc)(x, log_precision=lp, timestamps=ts, return_precision=True)
    y2, p2 = copy.deepcopy(enc)(x2, log_precision=lp2, timestamps=ts2, return_precision=True)
    torch.testing.assert_close(y1[:, :5], y2[:, :5])
    torch.testing.assert_close(p1[:, :5], p2[:, :5])
    assert not torch.allclose(y1[:, 5:], y2[:, 5:])


def test_gain_range_precision_bound_and_empty_rows() -> None:
    enc = HSTUEncoder(hstu_layer(precision="on", q_init=0.05), num_layers=3).eval()
    set_recording(enc, True)
    x = torch.randn(3, 10, D)
    pad = torch.arange(10).expand(3, 10) < torch.tensor([[0], [6], [9]])  # left padding
    enc(x, pad, log_precision=torch.randn(3, 10, H) * 4, timestamps=stamps(3, 10))
    for layer in enc.layers:
        s = layer.last_stats
        k = s.gain[s.valid]
        assert ((k > 0) & (k <= 1)).all()
        assert (s.gain[~s.valid] == 0).all()  # causal + left padding: no valid key
        assert (s.log_prec_out[s.valid].exp() <= 1 / s.q + 1e-3).all()
        assert torch.isneginf(s.log_prec_out[~s.valid]).all()
        assert (s.n_eff[s.valid] >= 1 - 1e-5).all()


def test_sill_is_a_running_statistic() -> None:
    layer = hstu_layer(precision="on")
    before = layer.sill.clone()
    layer.train()(torch.randn(4, 6, D))
    assert torch.equal(layer.sill, before)  # staged: applied before the next step
    layer.flush_sill()  # (the stacks flush at the start of each forward)
    assert not torch.equal(layer.sill, before)
    frozen = layer.sill.clone()
    layer.eval()(torch.randn(4, 6, D))
    layer.flush_sill()
    assert torch.equal(layer.sill, frozen)


def test_gradients_reach_tau_and_rho() -> None:
    enc = HSTUEncoder(hstu_layer(precision="on"), num_layers=3)
    prior = PrecisionPrior(10, width=H, init="constant", scale=2.0)
    ids = torch.randint(1, 10, (2, 6))
    ids[0, :2] = 0
    y, lp = enc(torch.randn(2, 6, D), ids == 0, log_precision=prior(ids), return_precision=True)
    y.square().mean().backward(retain_graph=True)
    assert prior.log_tau.weight.grad[1:].abs().sum() > 0
    assert prior.log_tau.weight.grad[0].abs().sum() == 0  # padding: precision 0, no gradient
    for layer in enc.layers[:-1]:  # their lambda'' feeds the next layer, hence the loss
        assert layer.rho.grad is not None and layer.rho.grad.abs().sum() > 0
    lp[torch.isfinite(lp)].sum().backward()
    assert enc.layers[-1].rho.grad.abs().sum() > 0


@pytest.mark.parametrize("precision", ["off", "on"])
def test_no_nan_bf16_long_and_almost_all_padding(precision: str) -> None:
    t = 512
    enc = HSTUEncoder(hstu_layer(precision=precision, max_len=t), num_layers=2)
    pad = torch.zeros(2, t, dtype=torch.bool)
    pad[1, :-1] = True  # all but one position padded (left)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, lp = enc(torch.randn(2, t, D), pad, log_precision=torch.zeros(2, t, H),
                    timestamps=stamps(2, t), return_precision=True)  # fmt: skip
    assert torch.isfinite(y[~pad]).all()
    if precision == "on":
        assert lp.dtype == torch.float32 and torch.isfinite(lp[~pad]).all()
    y.float()[~pad].sum().backward()
    for p in enc.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()


def test_recording_and_bad_arguments() -> None:
    layer = hstu_layer(precision="on")
    layer(torch.randn(1, 3, D))
    assert layer.last_stats is None
    layer.record = True
    layer(torch.randn(1, 3, D))
    s = layer.last_stats
    assert s is not None and s.attention is None and not s.gain.requires_grad
    assert s.jbar.abs().sum() == 0  # no FFN
    with pytest.raises(ValueError, match="precision"):
        hstu_layer(precision="maybe")
    with pytest.raises(ValueError, match="groups"):
        hstu_layer(groups=3)
    with pytest.raises(ValueError, match="max_len"):
        layer(torch.randn(1, N + 1, D))
