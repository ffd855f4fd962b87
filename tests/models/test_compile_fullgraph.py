"""``torch.compile(fullgraph=True)`` of every BFT backbone (no graph break), forward and
backward, train and eval, with padding, causal masks and dropout, on the compile-friendly
``attention_impl="blockwise"``: the compiled model gives the eager model's outputs,
gradients and running sill, and varying sequence lengths compile at most twice."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from bft_lightning.lm.config import LlamaConfig
from bft_lightning.lm.model import LlamaForCausalLM
from bft_lightning.lm.options import BFTOptions
from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.nn.filter import FilterConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ITEMS, L = 50, 12
LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
BACKBONES = ("sasrec", "bert4rec", "hstu", "llama")


def build(name: str, dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        bft = BFTOptions(
            filter=FilterConfig(precision="on", attention_impl="blockwise"), dropout=dropout
        )
        return LlamaForCausalLM(LlamaConfig(**LLAMA), bft)  # type: ignore[arg-type]
    cls = {"sasrec": SASRec, "bert4rec": BERT4Rec, "hstu": HSTU}[name]
    return cls(ITEMS, L, d_model=16, nhead=2, num_layers=2, dim_feedforward=32,
               precision="on", attention_impl="blockwise", dropout=dropout)  # fmt: skip


def batch(name: str, t: int = L, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Ids (3, t) with left padding in row 0 (and, for the LM, its attention mask)."""
    g = torch.Generator().manual_seed(seed)
    if name == "llama":
        ids = torch.randint(4, LLAMA["vocab_size"], (3, t), generator=g)
        mask = torch.ones_like(ids)
        mask[0, : t // 2] = 0
        return ids, mask
    ids = torch.randint(1, ITEMS + 1, (3, t), generator=g)
    ids[0, : t // 2] = 0
    return (ids,)


def forward_of(name: str, model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The backbone's states: ``encode``'s hidden states, or the LM's logits."""
    if name == "llama":
        return lambda ids, mask: model(ids, mask).logits
    return lambda ids: model.encode(ids)[0]  # type: ignore[operator]


def step(model: torch.nn.Module, fn: Callable[..., torch.Tensor], inputs: tuple, seed: int):
    """One forward and backward from the RNG state ``seed``: (output, grads by name)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = fn(*inputs)
    if torch.is_grad_enabled() and model.training:
        (out.float().square().mean() + out.float().sum() * 1e-2).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def compare(name: str, train: bool, dropout: float, steps: int = 2, **tol: float) -> None:
    """Eager and compiled (aot_eager, fullgraph) copies over ``steps`` training steps or an
    eval pass: outputs, every gradient and the state (the running sill) agree."""
    torch._dynamo.reset()
    eager = build(name, dropout).train(train)
    compiled = copy.deepcopy(eager)
    fn = torch.compile(forward_of(name, compiled), fullgraph=True, backend="aot_eager")
    for i in range(steps):
        inputs = batch(name, seed=i)
        out_e, grads_e = step(eager, forward_of(name, eager), inputs, seed=10 + i)
        out_c, grads_c = step(compiled, fn, inputs, seed=10 + i)
        torch.testing.assert_close(out_c, out_e, **tol)  # type: ignore[arg-type]
        assert grads_e.keys() == grads_c.keys()
        assert bool(grads_e) == train  # eval: no backward
        for key in grads_e:
            torch.testing.assert_close(grads_c[key], grads_e[key], **tol, msg=key)  # type: ignore[arg-type]
    state_e, state_c = eager.state_dict(), compiled.state_dict()
    for key in state_e:
        torch.testing.assert_close(state_c[key], state_e[key], **tol, msg=key)  # type: ignore[arg-type]
    sills = [k for k in state_e if k.endswith(".sill")]
    assert sills
    if train:  # the running sill moved, the same way in both
        assert any(not torch.equal(state_e[k], torch.ones_like(state_e[k])) for k in sills)


@pytest.mark.parametrize("name", BACKBONES)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fullgraph_training_matches_eager(name, dropout):
    # aot_eager runs the same ATen ops from the same RNG state: dropout masks, outputs,
    # gradients and the running sill are bit-for-bit the eager ones
    compare(name, train=True, dropout=dropout, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("name", BACKBONES)
def test_fullgraph_eval_matches_eager(name):
    with torch.no_grad():
        compare(name, train=False, dropout=0.1, steps=1, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("name", ["sasrec", pytest.param("llama", marks=pytest.mark.slow)])
def test_fullgraph_bfloat16_autocast_matches_eager(name):
    # the attention kernel and the FFN under bfloat16 autocast, the precision path in float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compare(name, train=True, dropout=0.0, rtol=2e-2, atol=2e-2)


def test_training_with_dropout_differs_from_dropout_off():
    """Dropout is live under compile: the same model with p = 0.1 and p = 0 differ."""
    outs = []
    for p in (0.1, 0.0):
        torch._dynamo.reset()
        model = build("sasrec", p).train()
        fn = torch.compile(forward_of("sasrec", model), fullgraph=True, backend="aot_eager")
        torch.manual_seed(3)
        outs.append(fn(*batch("sasrec")))
    assert not torch.allclose(outs[0], outs[1])


@pytest.mark.parametrize(
    "name",
    ["sasrec", "hstu", pytest.param("bert4rec", marks=pytest.mark.slow),
     pytest.param("llama", marks=pytest.mark.slow)],
)  # fmt: skip
def test_varying_lengths_compile_at_most_twice(name):
    torch._dynamo.reset()
    model = build(name, 0.1).train()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(forward_of(name, model), fullgraph=True, backend=counter)
    for t in (5, 7, 9, 12):
        inputs = batch(name, t)
        for x in inputs:  # the sequence length is dynamic from the first call
            torch._dynamo.mark_dynamic(x, 1)
        out = fn(*inputs)
        assert out.shape[1] == t
        out.float().square().mean().backward()
    assert counter.frame_count <= 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sasrec", "hstu"])
def test_inductor_matches_eager(name):
    """The inductor backend (CPU code generation): same outputs and gradients in float32."""
    torch._dynamo.reset()
    eager = build(name, 0.0).train()
    compiled = copy.deepcopy(eager)
    fn = torch.compile(forward_of(name, compiled), fullgraph=True, backend="inductor")
    for i in range(2):
        inputs = batch(name, seed=i)
        out_e, grads_e = step(eager, forward_of(name, eager), inputs, seed=i)
        out_c, grads_c = step(compiled, fn, inputs, seed=i)
        torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
        for key in grads_e:
            torch.testing.assert_close(grads_c[key], grads_e[key], rtol=1e-3, atol=1e-5, msg=key)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[key], value, rtol=1e-4, atol=1e-6)
