"""The filter step, once: its config, its sill policy and its kernel dispatch."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from bft_lightning.nn import (
    BFTEncoder,
    BFTEncoderLayer,
    HSTUEncoder,
    HSTULayer,
    decoder,
    hstu,
    kernels,
    layers,
)
from bft_lightning.nn.filter import FilterConfig, FilterLayer
from bft_lightning.nn.kernels import reference

D = 16


@pytest.mark.parametrize(
    "field, value",
    [
        ("precision", "maybe"),
        ("groups", 0),
        ("q_init", 0.0),
        ("nu0", -1.0),
        ("sill_momentum", 1.5),
        ("predict_noise", 1),
        ("gain", "token"),
        ("key_precision", "yes"),
        ("attention_gate", "tanh"),
        ("attention_impl", "flash"),
        ("attention_chunk", 0),
        ("backward", "traced"),
    ],
)
def test_a_bad_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        FilterConfig(**{field: value})  # type: ignore[arg-type]


def test_config_checks_across_fields_and_is_frozen() -> None:
    with pytest.raises(ValueError, match="gain='head' takes no attention_gate"):
        FilterConfig(gain="head", attention_gate="sigmoid")
    with pytest.raises(ValueError, match="gain='head' needs key_precision=True"):
        FilterConfig(gain="head", key_precision=False)
    config = FilterConfig()
    with pytest.raises(AttributeError):
        config.q_init = 0.5  # type: ignore[misc]
    assert config.replace(q_init=0.5).q_init == 0.5
    with pytest.raises(ValueError, match="q_init must be"):
        config.replace(q_init=-1.0)


def test_every_block_runs_the_one_filter_step() -> None:
    """The three blocks are FilterLayers and none of them writes the update itself."""
    assert issubclass(BFTEncoderLayer, FilterLayer) and issubclass(HSTULayer, FilterLayer)
    assert issubclass(decoder.BFTLlamaDecoderLayer, FilterLayer)
    for module in (layers, decoder, hstu):
        source = inspect.getsource(module)
        for step in ("kalman_gain", "update_log_precision", "predict_log_precision",
                     "update_running_sill_", "FilterStats.detached"):  # fmt: skip
            assert step not in source, (module.__name__, step)


def _stacks():
    torch.manual_seed(0)
    enc = BFTEncoder(BFTEncoderLayer(D, 2, 32, dropout=0.0, activation="gelu"), 2)
    hs = HSTUEncoder(HSTULayer(D, 2, max_len=8), 2)
    return {"encoder": (enc, {"is_causal": True}), "hstu": (hs, {})}


@pytest.mark.parametrize("name", ["encoder", "hstu"])
def test_gradient_checkpointing_gives_the_same_gradients_and_sill(name: str) -> None:
    """The sill policy's reason: a recomputed layer reads the sill its forward read and
    stages no second update, so checkpointing changes nothing (two training steps)."""
    results = []
    for ckpt in (False, True):
        stack, kw = _stacks()[name]
        for layer in stack.layers:
            layer.sill.fill_(0.05)  # far from the batch's variance: an update would show
        stack.train()
        x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
        grads = None
        for _ in range(2):
            for layer in stack.layers:
                layer.flush_sill()
            h, lp = x.clone().requires_grad_(), None
            for layer in stack.layers:
                if ckpt:
                    h, lp = checkpoint(layer, h, lp, use_reentrant=False, **kw)
                else:
                    h, lp = layer(h, lp, **kw)
            loss = h.square().mean() + lp.exp().mean() * 1e-3
            params = [p for p in stack.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        sills = torch.stack([layer.state_dict()["sill"] for layer in stack.layers])
        results.append((grads, sills))
    (g0, s0), (g1, s1) = results
    assert not torch.equal(s0, torch.full_like(s0, 0.05))  # the sill did move
    torch.testing.assert_close(s1, s0, rtol=0, atol=0)
    for a, b in zip(g0, g1, strict=True):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_the_stack_applies_the_staged_sill_and_a_saved_state_holds_it() -> None:
    stack, _ = _stacks()["encoder"]
    layer = stack.layers[0]
    x = torch.randn(2, 5, D)
    stack.train()(x)
    assert torch.equal(layer.sill, torch.ones(2))  # staged, not yet applied
    state = stack.state_dict()  # saving applies it (checkpoints hold every update)
    assert not torch.equal(state["layers.0.sill"], torch.ones(2))
    stack.train()(x)
    assert layer._pending_sill is not None
    stack.eval()(x)  # the next forward applies it; eval stages nothing
    assert layer._pending_sill is None
    fresh, _ = _stacks()["encoder"]
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.layers[0].sill, state["layers.0.sill"])


def test_a_kernel_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel added to KERNELS is what a layer naming it runs, with the reference's
    values and gradients when it computes the same thing."""
    calls = []

    def counting(*args):
        calls.append(1)
        return reference.kriging(*args)

    monkeypatch.setitem(kernels.KERNELS, "counting", kernels.Kernel(counting))
    torch.manual_seed(0)
    ref = BFTEncoderLayer(D, 2, 32, dropout=0.0, attention_impl="reference")
    new = BFTEncoderLayer(D, 2, 32, dropout=0.0, attention_impl="counting")
    new.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, D)
    outs = []
    for layer in (ref, new):
        leaf = x.clone().requires_grad_()
        h, lp = layer(leaf, is_causal=True)
        (grad,) = torch.autograd.grad(h.square().sum() + lp.sum(), leaf)
        outs.append((h, lp, grad))
    assert calls == [1]
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a)
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        BFTEncoderLayer(D, 2, attention_impl="flash")
