"""BFTEncoderLayer / BFTEncoder: reduction to torch, the properties of docs/spec.md."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bft_lightning.nn import BFTEncoder, BFTEncoderLayer, PrecisionPrior, set_recording
from bft_lightning.nn import functional as BF
from bft_lightning.nn import jacobian as J
from bft_lightning.nn.filter import FilterConfig

D, H, FF = 16, 4, 32


def torch_encoder(num_layers: int = 2, activation: str = "gelu") -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(
        D, H, FF, dropout=0.0, activation=activation, norm_first=True, batch_first=True
    )
    return nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False).eval()


def bft_layer(**kw) -> BFTEncoderLayer:
    opts = dict(d_model=D, nhead=H, dim_feedforward=FF, dropout=0.0, activation="gelu")
    opts.update(kw)
    return BFTEncoderLayer(**opts)


def right_pad(b: int, t: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(t).expand(b, t) >= torch.tensor(lengths).unsqueeze(1)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_off_equals_torch_layer(activation: str, causal: bool, padded: bool) -> None:
    ref = torch_encoder(1, activation).layers[0]
    mine = bft_layer(precision="off", activation=activation).eval()
    mine.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(3, 9, D)
    pad = right_pad(3, 9, [9, 6, 2]) if padded else None
    mask = nn.Transformer.generate_square_subsequent_mask(9) if causal else None
    expected = ref(x, src_mask=mask, src_key_padding_mask=pad, is_causal=causal)
    got, _ = mine(x, key_padding_mask=pad, is_causal=causal)
    keep = ~pad if pad is not None else torch.ones(3, 9, dtype=torch.bool)
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_from_torch_off_equals_encoder(causal: bool) -> None:
    enc = torch_encoder(3)
    enc.norm = nn.LayerNorm(D)
    mine = BFTEncoder.from_torch(enc, precision="off").eval()
    x, pad = torch.randn(2, 8, D), right_pad(2, 8, [8, 5])
    mask = nn.Transformer.generate_square_subsequent_mask(8) if causal else None
    expected = enc(x, mask=mask, src_key_padding_mask=pad, is_causal=causal)
    got = mine(x, src_key_padding_mask=pad, is_causal=causal)
    torch.testing.assert_close(got[~pad], expected[~pad], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_a_causal_window_mask_with_is_causal_equals_the_encoder(mask_dtype) -> None:
    """A mask narrower than causal (a window of 3) passed with ``is_causal=True`` is
    kept, as ``nn.TransformerEncoder`` keeps it (the flag then only adds causality)."""
    enc = torch_encoder(2)
    mine = BFTEncoder.from_torch(enc, precision="off").eval()
    i = torch.arange(8)
    blocked = (i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= 3)
    mask = (
        blocked if mask_dtype == torch.bool else torch.zeros(8, 8).masked_fill(blocked, -torch.inf)
    )
    x, pad = torch.randn(2, 8, D), right_pad(2, 8, [8, 5])
    expected = enc(x, mask=mask, src_key_padding_mask=pad, is_causal=True)
    got = mine(x, mask=mask, src_key_padding_mask=pad, is_causal=True)
    torch.testing.assert_close(got[~pad], expected[~pad], rtol=1e-5, atol=1e-5)
    plain_causal = mine(x, src_key_padding_mask=pad, is_causal=True)
    assert (plain_causal[~pad] - got[~pad]).abs().max() > 1e-3  # the window matters


def test_from_torch_rejects_post_norm_and_on_copies_weights() -> None:
    post = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(D, H, FF, batch_first=True), 1, enable_nested_tensor=False
    )
    with pytest.raises(ValueError, match="norm_first=True"):
        BFTEncoder.from_torch(post)
    enc = torch_encoder(2)
    on = BFTEncoder.from_torch(enc, precision="on", groups=2)
    torch.testing.assert_close(on.layers[1].linear1.weight, enc.layers[1].linear1.weight)
    assert on.layers[0].rho.shape == (2,)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="batch_first"):
        bft_layer(batch_first=False)
    with pytest.raises(ValueError, match="groups"):
        bft_layer(groups=3)
    with pytest.raises(ValueError, match="precision"):
        bft_layer(precision="maybe")
    with pytest.raises(ValueError, match="activation"):
        bft_layer(activation="tanh")


def test_uniform_precision_in_norm1_units_gives_softmax_attention() -> None:
    off = bft_layer(precision="off").eval()
    on = bft_layer(precision="on").eval()
    on.load_state_dict(off.state_dict(), strict=False)
    x = torch.randn(2, 7, D) * torch.rand(2, 7, 1) * 3  # tokens of different scales
    c = 5.0
    sigma1 = BF.norm_sigma(x, on.norm1.eps)
    log_prec = (torch.log(torch.tensor(c)) - 2 * torch.log(sigma1)).unsqueeze(-1).expand(2, 7, H)
    set_recording(off, True, attention=True)
    set_recording(on, True, attention=True)
    off(x, is_causal=True)
    on(x, log_prec, is_causal=True)
    torch.testing.assert_close(on.last_stats.attention, off.last_stats.attention)
    # and with K forced to 1 the layer is the plain layer: K only scales z
    k = on.last_stats.gain
    assert ((k > 0) & (k < 1)).all()


def test_no_precision_given_is_exactly_softmax_with_finite_gradients() -> None:
    """The default precision (none passed) is uniform in Norm1 units with Norm1's own
    eps: plain softmax also for embedding-scale inputs, and a constant token (a zeroed
    padding row) gets finite gradients."""
    off = bft_layer(precision="off").eval()
    on = bft_layer(precision="on").eval()
    on.load_state_dict(off.state_dict(), strict=False)
    x = (torch.randn(2, 7, D) * 0.02).requires_grad_(True)  # embedding-sized tokens
    with torch.no_grad():
        x[0, :2] = 0.0  # constant rows
    set_recording(off, True, attention=True)
    set_recording(on, True, attention=True)
    off(x, is_causal=True)
    out, lp = on(x, is_causal=True)
    torch.testing.assert_close(on.last_stats.attention, off.last_stats.attention)
    (out.square().sum() + lp.sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_uniform_precision_gives_softmax_plus_log_sigma_bias() -> None:
    on = bft_layer(precision="on").eval()
    x = torch.randn(1, 6, D) * torch.linspace(0.5, 3, 6).view(1, 6, 1)
    set_recording(on, True, attention=True)
    on(x, torch.zeros(1, 6, H))
    attn = on.self_attn
    q, k, _ = nn.functional.linear(on.norm1(x), attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1)
    q, k = (y.view(1, 6, H, -1).transpose(1, 2) for y in (q, k))
    scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5
    sig2 = BF.norm_sigma(x, on.norm1.eps).square()  # (1, T)
    expected = torch.softmax(scores + torch.log(sig2).view(1, 1, 1, 6), dim=-1)
    torch.testing.assert_close(on.last_stats.attention, expected, rtol=1e-4, atol=1e-5)


def _run_layers(enc: BFTEncoder, x, lp, pad, causal):
    outs = []
    h = x
    for layer in enc.layers:
        h, lp = layer(h, lp, key_padding_mask=pad, is_causal=causal)
        outs.append((h, lp))
    return outs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_invariance_every_layer(causal: bool, side: str) -> None:
    enc = BFTEncoder(bft_layer(precision="on", groups=2), num_layers=3).eval()
    t, n_pad = 6, 3
    x = torch.randn(1, t, D)
    lp = torch.randn(1, t, 2)
    junk = torch.randn(1, n_pad, D) * 100
    junk_lp = torch.randn(1, n_pad, 2)
    if side == "left":
        xp, lpp = torch.cat([junk, x], 1), torch.cat([junk_lp, lp], 1)
        pad = torch.arange(t + n_pad).unsqueeze(0) < n_pad
        sl = slice(n_pad, None)
    else:
        xp, lpp = torch.cat([x, junk], 1), torch.cat([lp, junk_lp], 1)
        pad = torch.arange(t + n_pad).unsqueeze(0) >= t
        sl = slice(0, t)
    ref = _run_layers(enc, x, lp, None, causal)
    got = _run_layers(enc, xp, lpp, pad, causal)
    for (h0, lp0), (h1, lp1) in zip(ref, got):
        torch.testing.assert_close(h1[:, sl], h0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lp1[:, sl], lp0, rtol=1e-4, atol=1e-5)
        assert torch.isneginf(lp1[pad]).all()  # precision 0 stays absorbing


def test_padding_by_precision_alone_equals_mask() -> None:
    enc = BFTEncoder(bft_layer(precision="on"), num_layers=2).eval()
    x, lp = torch.randn(2, 5, D), torch.randn(2, 5, H)
    pad = right_pad(2, 5, [5, 3])
    y1, lp1 = enc(x, src_key_padding_mask=pad, log_precision=lp, return_precision=True)
    y2, lp2 = enc(x, log_precision=lp.masked_fill(pad.unsqueeze(-1), float("-inf")),
                  return_precision=True)  # fmt: skip
    torch.testing.assert_close(y1[~pad], y2[~pad])
    torch.testing.assert_close(lp1, lp2)


@pytest.mark.parametrize("train", [False, True])
def test_causality(train: bool) -> None:
    enc = BFTEncoder(bft_layer(precision="on"), num_layers=2)
    enc.train(train)
    x, lp = torch.randn(2, 8, D), torch.randn(2, 8, H)
    x2, lp2 = x.clone(), lp.clone()
    x2[:, 5] += 10.0
    lp2[:, 5] -= 3.0
    y1, p1 = copy.deepcopy(enc)(x, is_causal=True, log_precision=lp, return_precision=True)
    y2, p2 = copy.deepcopy(enc)(x2, is_causal=True, log_precision=lp2, return_precision=True)
    torch.testing.assert_close(y1[:, :5], y2[:, :5])
    torch.testing.assert_close(p1[:, :5], p2[:, :5])
    assert not torch.allclose(y1[:, 5:], y2[:, 5:])


def test_sill_is_a_running_statistic() -> None:
    layer = bft_layer(precision="on")
    before = layer.sill.clone()
    layer.train()(torch.randn(4, 6, D))
    assert torch.equal(layer.sill, before)  # staged: applied before the next step
    layer.flush_sill()  # (the stacks flush at the start of each forward)
    assert not torch.equal(layer.sill, before)
    frozen = layer.sill.clone()
    layer.eval()(torch.randn(4, 6, D))
    layer.flush_sill()
    assert torch.equal(layer.sill, frozen)
    # a single token still has a finite, positive observation precision
    set_recording(layer, True)
    layer(torch.randn(1, 1, D))
    assert torch.isfinite(layer.last_stats.log_prec_obs).all()


def test_gain_range_and_precision_bound() -> None:
    enc = BFTEncoder(bft_layer(precision="on", q_init=0.05), num_layers=3).eval()
    set_recording(enc, True)
    x, pad = torch.randn(3, 10, D), right_pad(3, 10, [10, 4, 1])
    enc(x, src_key_padding_mask=pad, is_causal=True, log_precision=torch.randn(3, 10, H) * 4)
    for layer in enc.layers:
        s = layer.last_stats
        k = s.gain[s.valid]
        assert ((k > 0) & (k < 1)).all()
        lam = s.log_prec_out[s.valid].exp()
        assert (lam <= 1 / s.q + 1e-3).all()
        assert torch.isneginf(s.log_prec_out[~s.valid]).all()


def test_no_valid_key_rows_have_zero_gain() -> None:
    layer = bft_layer(precision="on").eval()
    set_recording(layer, True)
    pad = torch.tensor([[True, True, False, False]])  # left padding, causal: rows 0-1 empty
    h, lp = layer(torch.randn(1, 4, D), key_padding_mask=pad, is_causal=True)
    assert torch.isfinite(h).all()
    assert (layer.last_stats.gain[0, :2] == 0).all()
    assert (layer.last_stats.gain[0, 2:] > 0).all()


def test_gradients_reach_tau_and_rho() -> None:
    enc = BFTEncoder(bft_layer(precision="on"), num_layers=3)
    prior = PrecisionPrior(10, width=H, init="constant", scale=2.0)
    ids = torch.randint(1, 10, (2, 6))
    ids[0, :2] = 0
    x = torch.randn(2, 6, D)
    y, lp = enc(x, src_key_padding_mask=ids == 0, log_precision=prior(ids), return_precision=True)
    y.square().mean().backward(retain_graph=True)
    assert prior.log_tau.weight.grad[1:].abs().sum() > 0
    assert prior.log_tau.weight.grad[0].abs().sum() == 0  # padding id: precision 0, no gradient
    for layer in enc.layers[:-1]:  # their lambda'' feeds the next layer, hence the loss
        assert layer.rho.grad is not None and layer.rho.grad.abs().sum() > 0
    # the last layer's Q feeds the loss only when the head reads the final precision
    last_before = enc.layers[-1].rho.grad
    assert last_before is None or last_before.abs().sum() == 0
    lp[torch.isfinite(lp)].sum().backward()
    assert enc.layers[-1].rho.grad.abs().sum() > 0


def test_no_nan_bf16_long_and_almost_all_padding() -> None:
    enc = BFTEncoder(bft_layer(precision="on"), num_layers=2)
    x = torch.randn(2, 1024, D)
    pad = torch.zeros(2, 1024, dtype=torch.bool)
    pad[1, 1:] = True  # all but one position padded
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, lp = enc(x, src_key_padding_mask=pad, is_causal=True,
                    log_precision=torch.zeros(2, 1024, H), return_precision=True)  # fmt: skip
    assert lp.dtype == torch.float32
    assert torch.isfinite(y[~pad]).all()
    assert torch.isfinite(lp[~pad]).all()
    y.float()[~pad].sum().backward()
    for p in enc.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_precision_path_is_float32_under_bf16_autocast(activation: str) -> None:
    """Under bf16 autocast the FFN's GEMMs run in bf16 but its Jacobian product (and
    with it J-bar and lambda'') stays float32, for either activation, and the backward runs
    through the precision path (ReLU once met a float32 derivative against a bf16
    gradient there)."""
    torch.manual_seed(0)
    layer = bft_layer(precision="on", activation=activation)
    set_recording(layer, True)
    x = torch.randn(2, 6, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, lp = layer(x, torch.randn(2, 6, H))
    assert lp.dtype == torch.float32 and layer.last_stats.jbar.dtype == torch.float32
    (y.float().sum() + lp.sum()).backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["linear1.weight"].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_running_sill_stays_float32_and_moves_after_a_cast(dtype) -> None:
    """``model.to(bf16)`` casts every buffer; the running sill is put back in float32,
    where a step of momentum 0.01 is not rounded away as it is in bf16."""
    from bft_lightning.nn.decoder import BFTLlamaDecoderLayer
    from bft_lightning.nn.hstu import HSTULayer

    others = [
        BFTLlamaDecoderLayer(32, 4, 2, 64, config=FilterConfig(precision="on")),
        HSTULayer(D, H, max_len=8),
    ]
    for other in others:  # the same rule in every layer that keeps a running sill
        assert other.to(dtype).sill.dtype == torch.float32
    layer = bft_layer(precision="on").to(dtype)
    assert layer.sill.dtype == torch.float32 and layer.linear1.weight.dtype == dtype
    assert bft_layer(precision="on").double().sill.dtype == torch.float64
    sign = (-1.0) ** torch.arange(16).view(1, 1, 16, 1)  # mean 0 over positions
    values = 1.2**0.5 * sign.expand(4, H, 16, D // H)  # variance 1.2 per head, exactly
    valid = torch.ones(4, 16, dtype=torch.bool)
    for _ in range(50):  # each step 0.01 x 0.2 = 0.002: below half a bf16 spacing at 1
        BF.update_running_sill_(layer.sill, values, valid, momentum=0.01)
    want = torch.full((H,), 1 + 0.2 * (1 - 0.99**50))
    torch.testing.assert_close(layer.sill, want)


@pytest.mark.parametrize("groups", [1, H, D])
def test_groups_agree_with_per_channel_delta_rule(groups: int) -> None:
    """Pooled precision propagation equals the unpooled per-channel computation."""
    ref = bft_layer(precision="on", groups=D).eval()  # per channel: no pooling
    mine = bft_layer(precision="on", groups=groups).eval()
    weights = {k: v for k, v in ref.state_dict().items() if k != "rho"}
    mine.load_state_dict(weights, strict=False)
    x = torch.randn(2, 5, D)
    lp_group = torch.randn(2, 5, groups)
    lp_channel = BF.expand_groups(lp_group, D)  # same per-channel variance inside a group
    set_recording(ref, True, attention=True)
    set_recording(mine, True, attention=True)
    ref(x, lp_channel)
    mine(x, lp_group)
    # observe: identical kriging weights (the neighbour precision is per head)
    torch.testing.assert_close(mine.last_stats.attention, ref.last_stats.attention)
    # lambda_obs of a group = 1 / mean over its channels of the per-channel variance
    s2_channel = torch.exp(-ref.last_stats.log_prec_obs)  # (B, T, D)
    s2_group = s2_channel.view(2, 5, groups, D // groups).mean(-1)
    torch.testing.assert_close(mine.last_stats.log_prec_obs, -torch.log(s2_group))
    # predict: the pooled Jacobian matrix is the group mean of the per-channel one
    w1, w2, g2 = ref.linear1.weight, ref.linear2.weight, ref.norm2.weight
    m_channel = J.ffn_jacobian_matrix(w1, w2, g2, D)  # (F, D)
    torch.testing.assert_close(
        J.ffn_jacobian_matrix(w1, w2, g2, groups), m_channel.view(FF, groups, -1).mean(-1)
    )


def test_recording_is_off_by_default_and_detached() -> None:
    layer = bft_layer(precision="on")
    layer(torch.randn(1, 3, D))
    assert layer.last_stats is None
    layer.record = True
    layer(torch.randn(1, 3, D))
    s = layer.last_stats
    assert s is not None and s.attention is None and not s.gain.requires_grad


def test_gated_attention_runs_in_both_modes() -> None:
    for precision in ("off", "on"):
        layer = bft_layer(precision=precision, attention_gate="sigmoid")
        layer.record = True
        h, _ = layer(torch.randn(2, 4, D), is_causal=True)
        assert torch.isfinite(h).all() and layer.last_stats.gate.shape == (2, 4, D)


def _per_head_gain_reference(layer: BFTEncoderLayer, h: torch.Tensor, lp: torch.Tensor):
    """float64, one head at a time, per channel: the per-head gain layer written out."""
    attn, d, nh = layer.self_attn, layer.d_model, layer.nhead
    dh, g = d // nh, lp.shape[-1]
    b, t, _ = h.shape
    sigma1 = (h.var(-1, unbiased=False) + layer.norm1.eps).sqrt()  # (B, T)
    x = layer.norm1(h)
    q, k, v = torch.nn.functional.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1)
    var_in = torch.exp(-lp).repeat_interleave(d // g, -1) / sigma1.unsqueeze(-1) ** 2  # (B,T,D)
    w_v = attn.value_weight * layer.norm1.weight  # gamma folded in
    var_v = var_in @ w_v.square().t()  # (B, T, D) per value channel
    lam_bar = 1.0 / var_v.view(b, t, nh, dh).mean(-1)  # (B, T, H)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    heads, gains = [], []
    for a in range(nh):
        sl = slice(a * dh, (a + 1) * dh)
        scores = q[..., sl] @ k[..., sl].transpose(1, 2) / dh**0.5 + lam_bar[:, None, :, a].log()
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # (B, T, T)
        e = p @ v[..., sl]  # (B, T, dh)
        spread = (p * (v[..., sl].unsqueeze(1) - e.unsqueeze(2)).square().mean(-1)).sum(-1)
        n_eff = 1.0 / p.square().sum(-1)
        sill = layer.sill[a]
        sigma2 = (layer.nu0 * sill + n_eff * spread) / (layer.nu0 + n_eff - 1.0)
        lam_obs = n_eff / sigma2
        k_a = lam_obs / (lam_obs + lam_bar[..., a])  # (B, T)
        heads.append(k_a.unsqueeze(-1) * e)
        gains.append(k_a)
    h1 = h + attn.out_proj(torch.cat(heads, -1))
    a1 = layer.linear1(layer.norm2(h1))
    return h1 + layer.linear2(torch.nn.functional.gelu(a1)), torch.stack(gains, -1)


@pytest.mark.parametrize("groups", [1, H, D])
def test_per_head_gain_equals_its_definition(groups: int) -> None:
    """gain='head': K_a = lambda_obs_a / (lambda_bar_a + lambda_obs_a) on e_a, before W_O."""
    torch.manual_seed(0)
    layer = bft_layer(precision="on", gain="head", groups=groups).double().eval()
    layer.sill = torch.rand(H, dtype=torch.float64) + 0.5  # a trained-looking sill
    h = torch.randn(2, 6, D, dtype=torch.float64) * 3
    lp = torch.randn(2, 6, groups, dtype=torch.float64)
    set_recording(layer, True)
    y, _ = layer(h, lp, is_causal=True)
    want, gain = _per_head_gain_reference(layer, h, lp)
    # the filter's statistics run in float32 (docs/spec.md, Observe), also for float64 inputs
    torch.testing.assert_close(layer.last_stats.gain.double(), gain, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    assert layer.last_stats.gain.shape == (2, 6, H)


def test_per_head_gain_keeps_the_posterior_precision() -> None:
    """The gain's mode changes what the residual adds, not what the filter knows."""
    grp, head = bft_layer(precision="on").eval(), bft_layer(precision="on", gain="head").eval()
    head.load_state_dict(grp.state_dict())
    x, lp = torch.randn(2, 7, D), torch.randn(2, 7, H)
    for layer in (grp, head):
        set_recording(layer, True)
        layer(x, lp, is_causal=True)
    s0, s1 = grp.last_stats, head.last_stats
    torch.testing.assert_close(s1.log_prec_obs, s0.log_prec_obs)
    torch.testing.assert_close(s1.log_prec_post, s0.log_prec_post)
    assert not torch.allclose(s1.gain, s0.gain)


@pytest.mark.parametrize("causal", [False, True])
def test_per_head_gain_padding_and_empty_rows(causal: bool) -> None:
    enc = BFTEncoder(bft_layer(precision="on", gain="head"), num_layers=2).eval()
    x, lp = torch.randn(1, 5, D), torch.randn(1, 5, H)
    junk = torch.randn(1, 3, D) * 100
    pad = torch.arange(8).unsqueeze(0) < 3
    y0 = enc(x, is_causal=causal, log_precision=lp)
    y1 = enc(torch.cat([junk, x], 1), src_key_padding_mask=pad, is_causal=causal,
             log_precision=torch.cat([torch.randn(1, 3, H), lp], 1))  # fmt: skip
    torch.testing.assert_close(y1[:, 3:], y0, rtol=1e-4, atol=1e-5)
    layer = enc.layers[0]
    set_recording(layer, True)
    layer(torch.cat([junk, x], 1), key_padding_mask=pad, is_causal=True)
    assert (layer.last_stats.gain[0, :3] == 0).all() and (layer.last_stats.gain[0, 3:] > 0).all()


def test_per_head_gain_options_are_checked() -> None:
    with pytest.raises(ValueError, match="gain must be one of"):
        bft_layer(precision="on", gain="channel")
    with pytest.raises(ValueError, match="attention_gate"):
        bft_layer(precision="on", gain="head", attention_gate="sigmoid")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_key_precision_off_is_the_filter_with_a_zero_bias(impl: str, causal: bool, monkeypatch):
    """key_precision=False: the same layer as the spec's with the attention bias set to 0.

    Values, precisions and gradients (to the states and to the prior) of the
    ablation equal those of the full layer whose neighbour log-precision bias is
    replaced by zeros; and with the bias the layer differs (the bias is live).
    """
    torch.manual_seed(0)
    full = bft_layer(precision="on", attention_impl=impl).double().eval()
    ablated = bft_layer(precision="on", attention_impl=impl, key_precision=False).double()
    ablated.load_state_dict(full.state_dict())
    ablated.eval()
    h0 = torch.randn(2, 7, D, dtype=torch.float64) * 2
    lp0 = torch.randn(2, 7, H, dtype=torch.float64) * 2  # precision that differs by token
    pad = right_pad(2, 7, [7, 4])

    def run(layer: BFTEncoderLayer) -> tuple[torch.Tensor, ...]:
        h, lp = h0.clone().requires_grad_(), lp0.clone().requires_grad_()
        y, lp_out = layer(h, lp, key_padding_mask=pad, is_causal=causal)
        keep = ~pad
        (y[keep].sin().sum() + lp_out[keep].cos().sum()).backward()
        return y[keep], lp_out[keep], h.grad, lp.grad

    got = run(ablated)
    with_bias = run(full)
    zero = BF.neighbour_log_precision
    monkeypatch.setattr(BF, "neighbour_log_precision", lambda *a: torch.zeros_like(zero(*a)))
    want = run(full)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert not torch.allclose(with_bias[0], want[0])  # the bias changes the layer
    assert got[3].abs().sum() > 0  # the prior still reaches the output through the gain


def test_key_precision_off_attends_as_the_off_twin() -> None:
    """Its attention weights are the plain softmax's; its gain still reads the prior."""
    torch.manual_seed(0)
    off = bft_layer(precision="off").eval()
    ablated = bft_layer(precision="on", key_precision=False).eval()
    ablated.load_state_dict(off.state_dict(), strict=False)  # rho and sill: BFT only
    x = torch.randn(2, 6, D)
    set_recording(off, True, attention=True)
    set_recording(ablated, True, attention=True)
    off(x, is_causal=True)
    ablated(x, torch.randn(2, 6, H) * 2, is_causal=True)
    torch.testing.assert_close(ablated.last_stats.attention, off.last_stats.attention)
    gain0 = ablated.last_stats.gain
    ablated(x, torch.randn(2, 6, H) * 2, is_causal=True)
    torch.testing.assert_close(ablated.last_stats.attention, off.last_stats.attention)
    assert not torch.allclose(ablated.last_stats.gain, gain0)
    assert "key_precision=False" in repr(ablated)
    with pytest.raises(ValueError, match="key_precision"):
        bft_layer(precision="on", gain="head", key_precision=False)


@pytest.mark.parametrize("precision", ["off", "on"])
def test_float_attn_mask_is_a_mask_and_a_score_bias_is_refused(precision: str) -> None:
    """A float mask of 0 / -inf blocks exactly what the bool mask blocks; finite
    additive values (a score bias, which torch.nn also accepts) raise instead of
    being dropped silently."""
    layer = bft_layer(precision=precision).eval()
    x = torch.randn(2, 5, D)
    blocked = torch.rand(5, 5) < 0.3
    blocked.fill_diagonal_(False)
    as_float = torch.zeros(5, 5).masked_fill(blocked, float("-inf"))
    y_bool, _ = layer(x, attn_mask=blocked)
    y_float, _ = layer(x, attn_mask=as_float)
    torch.testing.assert_close(y_float, y_bool, rtol=0, atol=0)
    with pytest.raises(ValueError, match="only 0 .allowed. and -inf"):
        layer(x, attn_mask=as_float + torch.randn(5, 5))
