"""BFT Llama decoder: the properties of docs/spec.md, the SwiGLU Jacobian, the KV cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lm_helpers import TINY

from bft_lightning.lm.model import (
    BFTOptions,
    LlamaConfig,
    LlamaForCausalLM,
    calibrate_precision,
)
from bft_lightning.nn import functional as BF
from bft_lightning.nn import functional_llama as FL
from bft_lightning.nn import kernels as kernels_module
from bft_lightning.nn.attention import build_allowed
from bft_lightning.nn.decoder import BFTLlamaDecoderLayer
from bft_lightning.nn.filter import FilterConfig, default_log_precision
from bft_lightning.nn.stats import find_filter_layers, set_recording

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread

V = TINY["vocab_size"]


def tiny(precision: str = "on", seed: int = 0, **bft: object) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(**TINY)
    return LlamaForCausalLM(cfg, BFTOptions.from_dict({"precision": precision, **bft})).eval()


def ids(b: int = 2, t: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, V, (b, t), generator=torch.Generator().manual_seed(seed))


def rope_for(t: int, layer: BFTLlamaDecoderLayer, b: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(t).expand(b, t)
    return FL.rope_tables(pos, layer.self_attn.head_dim, 10000.0, torch.float32)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("precision", ["on", "off"])
def test_padding_changes_no_valid_output(side: str, precision: str) -> None:
    model = tiny(precision)
    x = ids(1, 7)
    pad = torch.full((1, 4), 3)
    padded = torch.cat((pad, x), 1) if side == "left" else torch.cat((x, pad), 1)
    mask = torch.zeros_like(padded)
    if side == "left":
        mask[:, 4:] = 1
    else:
        mask[:, :7] = 1
    with torch.no_grad():
        ref = model(x)
        got = model(padded, mask)
    keep = mask[0].bool()
    torch.testing.assert_close(got.logits[0, keep], ref.logits[0], atol=1e-5, rtol=1e-5)
    if precision == "on":
        assert torch.isneginf(got.log_precision[0, ~keep]).all()  # padding stays at precision 0
        torch.testing.assert_close(got.log_precision[0, keep], ref.log_precision[0])


def test_causal_no_output_before_a_change() -> None:
    model = tiny("on")
    a = ids(1, 12)
    b = a.clone()
    b[0, 7] = (b[0, 7] + 5) % V
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la.logits[:, :7], lb.logits[:, :7])
    torch.testing.assert_close(la.log_precision[:, :7], lb.log_precision[:, :7])
    assert not torch.allclose(la.logits[:, 7:], lb.logits[:, 7:])


def test_gain_in_unit_interval_and_zero_only_without_keys() -> None:
    model = tiny("on")
    set_recording(model, True)
    x = ids(3, 9)
    mask = torch.ones_like(x)
    mask[1, :8] = 0  # all but one padded
    mask[2, :] = 0  # nothing valid
    with torch.no_grad():
        out = model(x, mask)
    assert torch.isfinite(out.logits).all()
    for _, layer in find_filter_layers(model):
        st = layer.last_stats
        assert st is not None
        assert ((st.gain >= 0) & (st.gain <= 1)).all()
        assert (st.gain[st.valid] > 0).all()  # every valid query has itself as a key
        assert (st.gain[2] == 0).all()


def test_stats_shapes_and_protocol() -> None:
    model = tiny("on")
    set_recording(model, True, attention=True)
    with torch.no_grad():
        model(ids(2, 6))
    layers = list(find_filter_layers(model))
    assert len(layers) == TINY["num_hidden_layers"]
    st = layers[0][1].last_stats
    g, h = 4, TINY["num_attention_heads"]
    assert st.gain.shape == (2, 6, g) and st.n_eff.shape == (2, 6, h)
    assert st.attention.shape == (2, h, 6, 6) and st.jbar.shape == (2, 6, g)
    torch.testing.assert_close(st.attention.sum(-1), torch.ones(2, h, 6))
    assert (layers[-1][1].last_stats.q == 0).all()  # the last layer has no process noise
    set_recording(model, False)
    assert layers[0][1].last_stats is None


def test_off_mode_records_unit_gain() -> None:
    model = tiny("off")
    set_recording(model, True, attention=True)
    with torch.no_grad():
        model(ids(1, 5))
    st = next(iter(find_filter_layers(model)))[1].last_stats
    assert (st.gain == 1).all() and (st.n_eff >= 1).all()


@pytest.mark.parametrize("length", [1, 300])
def test_no_nan_under_bf16_autocast(length: int) -> None:
    model = tiny("on").train()
    x = ids(2, length)
    mask = torch.ones_like(x)
    mask[1, : length - 1] = 0  # all but one padded
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, mask)
        loss = out.logits.float().logsumexp(-1)[mask.bool()].mean()
    loss.backward()
    assert torch.isfinite(out.logits.float()).all()
    assert out.log_precision.dtype == torch.float32
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


def test_gradients_reach_tau_and_rho() -> None:
    model = tiny("on").train()
    x = ids(2, 10)
    logits = model(x).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)).backward()
    prior = model.model.prior
    assert prior is not None and prior.log_tau.weight.grad is not None
    assert prior.log_tau.weight.grad[x.unique()].abs().sum() > 0
    layers = list(model.model.layers)
    for layer in layers[:-1]:
        assert layer.rho.grad is not None and layer.rho.grad.abs().sum() > 0
    assert layers[-1].rho is None  # no process noise in the last layer (its lambda'' feeds nothing)


def test_uniform_norm_units_precision_gives_softmax_weights() -> None:
    """docs/spec.md, Off mode: lambda = c / sigma1^2 (uniform in Norm1 units) gives softmax."""
    torch.manual_seed(0)
    on = BFTLlamaDecoderLayer(32, 4, 2, 64, config=FilterConfig(precision="on")).eval()
    off = BFTLlamaDecoderLayer(32, 4, 2, 64, config=FilterConfig(precision="off")).eval()
    off.load_state_dict(on.state_dict(), strict=False)
    for layer in (on, off):
        layer.record, layer.record_attention = True, True
    h = torch.randn(2, 8, 32) * torch.rand(2, 8, 1) * 3
    valid = torch.ones(2, 8, dtype=torch.bool)
    lp = 1.7 + default_log_precision(h, on.groups, on.input_layernorm.eps, rms=True)
    rope = rope_for(8, on, 2)
    with torch.no_grad():
        on(h, lp, rope, valid)
        off(h, None, rope, valid)
    torch.testing.assert_close(on.last_stats.attention, off.last_stats.attention)


def test_swiglu_pooled_jacobian_matches_autograd() -> None:
    """Jbar is the group mean of diag dSwiGLU(gamma h / sigma)/dh with sigma held fixed."""
    torch.manual_seed(0)
    d, f, g = 8, 12, 4
    w1, w3, w2 = torch.randn(f, d), torch.randn(f, d), torch.randn(d, f)
    gamma = torch.rand(d) + 0.5
    h = torch.randn(d)
    sigma = h.square().mean().sqrt()

    def ffn(x: torch.Tensor) -> torch.Tensor:
        u = gamma * x / sigma
        return w2 @ (F.silu(w1 @ u) * (w3 @ u))

    diag = torch.autograd.functional.jacobian(ffn, h).diagonal()
    expected = diag.reshape(g, d // g).mean(-1)
    u = gamma * h / sigma
    m1, m3 = FL.swiglu_jacobian_matrices(w1, w3, w2, gamma, g)
    got = FL.swiglu_pooled_jacobian(
        (w1 @ u)[None, None], (w3 @ u)[None, None], m1, m3, sigma.reshape(1, 1)
    )[0, 0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_rms_delta_rule_for_values_by_monte_carlo() -> None:
    """s2_v = sum_g P_V[a, g] / (lambda_g sigma^2) with P_V from W_V diag(gamma)."""
    torch.manual_seed(0)
    d, hkv, g, dh = 8, 2, 4, 3
    wv, gamma = torch.randn(hkv * dh, d), torch.rand(d) + 0.5
    lp = torch.randn(g)
    sigma = torch.tensor(1.7)
    noise = torch.randn(200_000, d) * BF.expand_groups(torch.exp(-0.5 * lp)[None], d)
    v = (gamma * noise / sigma) @ wv.t()  # (N, Hkv dh)
    empirical = v.var(0).reshape(hkv, dh).mean(-1)
    p_v = BF.delta_rule_matrix(wv, hkv, g, gamma)
    predicted = torch.exp(-BF.neighbour_log_precision(lp[None, None], sigma.reshape(1, 1), p_v))
    torch.testing.assert_close(predicted[0, :, 0], empirical, rtol=0.03, atol=0)


def test_causal_allowed_matches_build_allowed() -> None:
    valid = torch.tensor([[True, True, False, True, True], [False, True, True, True, True]])
    torch.testing.assert_close(FL.causal_allowed(valid, 5), build_allowed(valid, True))
    tail = FL.causal_allowed(valid, 2)
    torch.testing.assert_close(tail, build_allowed(valid, True)[:, :, 3:])


@pytest.mark.parametrize("precision", ["on", "off"])
def test_kv_cache_equals_full_forward(precision: str) -> None:
    model = tiny(precision, attention_gate="sigmoid")
    x = ids(2, 11)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding in the cached prefix
    with torch.no_grad():
        full = model(x, mask)
        first = model(x[:, :6], mask[:, :6], use_cache=True)
        second = model(x[:, 6:9], mask[:, 6:9], cache=first.cache)
        third = model(x[:, 9:], mask[:, 9:], cache=second.cache)
    step = torch.cat((first.logits, second.logits, third.logits), 1)
    keep = mask.bool()
    torch.testing.assert_close(step[keep], full.logits[keep], atol=1e-5, rtol=1e-5)
    if precision == "on":
        assert third.cache is not None and third.cache.layers[0].bias is not None
        lp = torch.cat((first.log_precision, second.log_precision, third.log_precision), 1)
        torch.testing.assert_close(lp[keep], full.log_precision[keep])


@pytest.mark.parametrize("precision", ["on", "off"])
def test_generation_with_and_without_cache_agree(precision: str) -> None:
    model = tiny(precision)
    x = ids(3, 8)
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    a = model.generate(x, mask, max_new_tokens=10, eos_token_id=-1, use_cache=True)
    b = model.generate(x, mask, max_new_tokens=10, eos_token_id=-1, use_cache=False)
    assert a.shape == (3, 10) and torch.equal(a, b)
    # the left-padded row generates what it generates alone
    alone = model.generate(x[1:2, 4:], max_new_tokens=10, eos_token_id=-1)
    assert torch.equal(alone[0], a[1])


def test_generation_stops_at_eos_and_pads() -> None:
    model = tiny("off")
    x = ids(2, 5)
    first = model.generate(x, max_new_tokens=1, eos_token_id=-1)
    eos = int(first[0, 0])  # make row 0's first token the EOS
    out = model.generate(x, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    assert out[0, 0] == eos and (out[0, 1:] == 0).all()


def test_generate_refuses_right_padding() -> None:
    model = tiny("off")
    x = ids(1, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(x, mask, max_new_tokens=2)


def test_calibration_starts_near_the_pretrained_model(hf_checkpoint) -> None:
    off = LlamaForCausalLM.from_pretrained(hf_checkpoint).eval()
    on = LlamaForCausalLM.from_pretrained(
        hf_checkpoint, BFTOptions(filter=FilterConfig(precision="on"))
    ).eval()
    report = calibrate_precision(on, ids(8, 32, seed=3), target_gain=0.95)
    for row in report.median_gain:
        assert all(0.9 < k < 0.99 for k in row), report.median_gain
    x = ids(8, 32, seed=4)  # held-out batch
    with torch.no_grad():
        p, q = off(x).logits.log_softmax(-1), on(x).logits.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean()
    assert kl < 0.05, kl
    assert not on.training and on.model.layers[0].record is False


def test_from_pretrained_prior_gives_softmax_at_layer_zero(hf_checkpoint) -> None:
    """log tau_i = -2 log rms(e_i): layer 0 sees precision uniform in RMSNorm units."""
    off = LlamaForCausalLM.from_pretrained(hf_checkpoint).eval()
    on = LlamaForCausalLM.from_pretrained(
        hf_checkpoint, BFTOptions(filter=FilterConfig(precision="on"))
    ).eval()
    set_recording(off, True, attention=True)
    set_recording(on, True, attention=True)
    x = ids(2, 9)
    with torch.no_grad():
        off(x), on(x)
    torch.testing.assert_close(
        on.model.layers[0].last_stats.attention, off.model.layers[0].last_stats.attention
    )


def test_pretrained_gate_starts_nearly_open(hf_checkpoint) -> None:
    on = LlamaForCausalLM.from_pretrained(
        hf_checkpoint, BFTOptions(filter=FilterConfig(precision="off", attention_gate="sigmoid"))
    )
    set_recording(on, True)
    with torch.no_grad():
        on.eval()(ids(1, 4))
    assert on.model.layers[0].last_stats.gate.min() > 0.98


def test_sill_updates_in_training_only() -> None:
    model = tiny("on")
    sill = model.model.layers[0].sill.clone()
    with torch.no_grad():
        model(ids())
    torch.testing.assert_close(model.model.layers[0].sill, sill)
    model.train()
    with torch.no_grad():
        model(ids())
    model.model.layers[0].flush_sill()  # updates apply at the next forward or on flush
    assert not torch.allclose(model.model.layers[0].sill, sill)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        BFTLlamaDecoderLayer(32, 4, config=FilterConfig(precision="maybe"))
    with pytest.raises(ValueError, match="groups"):
        BFTLlamaDecoderLayer(32, 4, config=FilterConfig(groups=5))
    with pytest.raises(ValueError, match="multiple"):
        LlamaConfig(**{**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="prior_width"):
        tiny("on", prior_width=3)


def test_gain_scales_the_attention_branch() -> None:
    """A very precise prior (K ~ 0) keeps h: the output is h + FFN(RMSNorm2(h))."""
    torch.manual_seed(0)
    layer = BFTLlamaDecoderLayer(32, 4, 2, 64, config=FilterConfig(precision="on")).eval()
    layer.record = True
    h = torch.randn(2, 6, 32)
    valid = torch.ones(2, 6, dtype=torch.bool)
    lp = torch.full((2, 6, 4), 20.0)
    with torch.no_grad():
        out, _, _ = layer(h, lp, rope_for(6, layer, 2), valid)
        expected = h + layer.mlp(layer.post_attention_layernorm(h))[0]
    assert layer.last_stats.gain.max() < 1e-4
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same gradients and sill; the recomputed layers do not update the sill again (under
    DDP each update is an all-reduce, which would then run inside the backward)."""
    x = ids(2, 9)
    grads, sills, calls = [], [], []
    real = BF.update_running_sill_
    monkeypatch.setattr(BF, "update_running_sill_", lambda *a: calls.append(1) or real(*a))
    for ckpt in (False, True):
        calls.clear()
        model = tiny("on").train()
        model.model.gradient_checkpointing = ckpt
        F.cross_entropy(model(x).logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert len(calls) == len(model.model.decoder_layers)  # once per layer, not twice
        for layer in model.model.decoder_layers:
            layer.flush_sill()
        sills.append(torch.stack([layer.sill for layer in model.model.decoder_layers]))
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sills[0], sills[1])


@pytest.mark.parametrize("gate", [None, "sigmoid"])
def test_chunked_attention_equals_reference_in_the_decoder(
    gate: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BFT decoder with query blocks of 3 (GQA, left padding, a cached prefix): the same
    logits, precision and gradients of every parameter as the materialised path (float64)."""
    models = {
        impl: tiny("on", attention_impl=impl, attention_chunk=3, attention_gate=gate).double()
        for impl in ("reference", "chunked")
    }
    x = ids(2, 11)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    outs, grads = {}, {}

    def materialised(*args: object, **kwargs: object) -> None:
        raise AssertionError("the chunked model took the materialised path")

    for impl, model in models.items():
        model.train()
        with monkeypatch.context() as patch:
            if impl == "chunked":
                patch.setattr(kernels_module, "reference_attention", materialised)
                patch.setattr(kernels_module.reference, "reference_attention", materialised)
            out = model(x, mask)
        (out.logits.square().mean() + out.log_precision[mask.bool()].mean()).backward()
        outs[impl] = out
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(outs["chunked"].logits, outs["reference"].logits)
    torch.testing.assert_close(outs["chunked"].log_precision, outs["reference"].log_precision)
    assert grads["chunked"].keys() == grads["reference"].keys()
    assert any("prior" in n for n in grads["reference"]) and any(
        "rho" in n for n in grads["reference"]
    )
    for name, g in grads["reference"].items():
        torch.testing.assert_close(grads["chunked"][name], g, msg=name)
    with torch.no_grad():  # cached decoding: queries see keys of earlier calls
        for model in models.values():
            model.eval()
        steps = {}
        for impl, model in models.items():
            with monkeypatch.context() as patch:
                if impl == "chunked":
                    patch.setattr(kernels_module, "reference_attention", materialised)
                    patch.setattr(kernels_module.reference, "reference_attention", materialised)
                first = model(x[:, :6], mask[:, :6], use_cache=True)
                steps[impl] = model(x[:, 6:], mask[:, 6:], cache=first.cache).logits
        torch.testing.assert_close(steps["chunked"], steps["reference"])


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_statistics_are_float32_under_bf16_autocast(impl: str) -> None:
    """Under bf16 autocast both paths compute the kriging statistics in float32, so
    they agree with each other far more closely than bf16 resolution (2^-8)."""
    models = {i: tiny("on", attention_impl=i, attention_chunk=4) for i in ("chunked", impl)}
    x = ids(2, 12)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lp = {i: m(x).log_precision for i, m in models.items()}
    set_recording(models[impl], True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        models[impl](x)
    stats = [layer.last_stats for _, layer in find_filter_layers(models[impl])]
    assert all(st is not None and st.gain.dtype == torch.float32 for st in stats)
    torch.testing.assert_close(lp[impl], lp["chunked"], atol=2e-3, rtol=2e-3)


def _plain_swiglu_product(a, b, m1, m3, sigma):
    (d1,) = torch.autograd.grad(F.silu(a).sum(), a, create_graph=True)
    return ((d1 * b) @ m1 + F.silu(a) @ m3) / sigma.unsqueeze(-1)


@pytest.mark.parametrize("traced", [False, True])
def test_swiglu_pooled_jacobian_keeps_only_a_and_b(traced: bool, monkeypatch) -> None:
    """The fused Function (eager) and the plain ops (traced) give the values and
    gradients of autograd's own silu', and the eager path keeps no (B, T, F) tensor
    for the backward but ``a`` and ``b``."""
    backward = "autograd" if traced else "custom"
    torch.manual_seed(0)
    leaves = [
        torch.randn(2, 5, 12, dtype=torch.float64) * 3,
        torch.randn(2, 5, 12, dtype=torch.float64),
        torch.randn(12, 3, dtype=torch.float64),
        torch.randn(12, 3, dtype=torch.float64),
        torch.rand(2, 5, dtype=torch.float64) + 0.5,
    ]
    mine = [t.clone().requires_grad_() for t in leaves]
    ref = [t.clone().requires_grad_() for t in leaves]
    got = FL.swiglu_pooled_jacobian(*mine, backward)
    want = _plain_swiglu_product(*ref)
    torch.testing.assert_close(got, want)
    w = torch.randn_like(got)
    for g1, g2 in zip(
        torch.autograd.grad((got * w).sum(), mine), torch.autograd.grad((want * w).sum(), ref)
    ):
        torch.testing.assert_close(g1, g2)
    assert torch.autograd.gradcheck(lambda *x: FL.swiglu_pooled_jacobian(*x, backward), tuple(mine))
    if traced:
        return
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        FL.swiglu_pooled_jacobian(*mine)
    big = [t for t in saved if t.shape == mine[0].shape]
    assert len(big) == 2 and big[0] is mine[0] and big[1] is mine[1]


def test_swiglu_pooled_jacobian_with_only_some_inputs_needing_gradients() -> None:
    """Frozen weights (m1, m3 without grad, as in LoRA-style fine-tuning) or a frozen b."""
    torch.manual_seed(1)
    a, b = torch.randn(1, 4, 6, dtype=torch.float64), torch.randn(1, 4, 6, dtype=torch.float64)
    m1, m3 = torch.randn(6, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    sigma = torch.ones(1, 4, dtype=torch.float64)
    cases = ([True, False, False, False], [False, False, True, True], [False, True, False, True])
    for needs in cases:
        mine = [t.clone().requires_grad_(n) for t, n in zip((a, b, m1, m3), needs)]
        ref = [t.clone().requires_grad_(True) for t in (a, b, m1, m3)]
        got = FL.swiglu_pooled_jacobian(*mine, sigma)
        want = _plain_swiglu_product(ref[0], ref[1], ref[2], ref[3], sigma)
        grads = torch.autograd.grad(got.sum(), [t for t in mine if t.requires_grad])
        wants = torch.autograd.grad(want.sum(), [r for r, n in zip(ref, needs) if n])
        for g1, g2 in zip(grads, wants):
            torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("traced", [False, True])
def test_swiglu_pooled_jacobian_in_float32_under_bf16_autocast(traced: bool, monkeypatch) -> None:
    """bf16 activations under autocast: the products run in float32 (eager and traced
    alike) and each gradient comes back in its input's dtype."""
    backward = "autograd" if traced else "custom"
    torch.manual_seed(2)
    a = (torch.randn(2, 3, 256) * 2).to(torch.bfloat16).requires_grad_()
    b = torch.randn(2, 3, 256).to(torch.bfloat16).requires_grad_()
    m1, m3 = torch.randn(256, 4, requires_grad=True), torch.randn(256, 4, requires_grad=True)
    sigma = torch.ones(2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = FL.swiglu_pooled_jacobian(a, b, m1, m3, sigma, backward)
    assert got.dtype == torch.float32
    ref = [t.detach().double().requires_grad_() for t in (a, b, m1, m3)]
    want = _plain_swiglu_product(*ref, sigma.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(got.sum(), (a, b, m1, m3))
    bf16, f32 = torch.bfloat16, torch.float32
    assert [g.dtype for g in grads] == [bf16, bf16, f32, f32]
    for g, w in zip(grads, torch.autograd.grad(want.sum(), ref)):
        torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=2e-2)
