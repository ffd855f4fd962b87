"""The task's ``compile=True``: the compile-friendly kernel by default, one graph for every
history length, and the eager task's losses and gradients."""

from __future__ import annotations

import functools
from functools import partial
from unittest.mock import patch

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.nn.kernels import resolve
from bft_lightning.tasks import SequentialRecommendation

pytestmark = pytest.mark.usefixtures("one_thread")

ITEMS, L = 40, 16


def kernels(task: SequentialRecommendation, compiling: bool) -> set[str]:
    """The kernels the attention modules run, eager or while ``torch.compile`` traces."""
    names = {m.impl for m in task.model.modules() if isinstance(getattr(m, "impl", None), str)}
    with patch.object(torch.compiler, "is_compiling", lambda: compiling):
        return {resolve(name) for name in names}


def task_of(compile_: bool, **backbone_kw) -> SequentialRecommendation:
    torch.manual_seed(0)
    cls = backbone_kw.pop("cls", SASRec)
    kw = dict(d_model=16, nhead=2, num_layers=2, dim_feedforward=32, precision="on")
    kw.update(backbone_kw)
    return SequentialRecommendation(ITEMS, L, backbone=partial(cls, **kw), compile=compile_)


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec])
def test_compile_runs_blockwise_unless_a_kernel_was_chosen(cls):
    assert kernels(task_of(False, cls=cls), compiling=False) == {"chunked"}
    task = task_of(True, cls=cls)
    assert kernels(task, compiling=True) == {"blockwise"}
    assert task.model.filter.attention_impl == "auto"  # resolved by the dispatch, not rewritten
    assert {layer.config.attention_impl for layer in task.model.encoder.layers} == {"auto"}
    for chosen in ("chunked", "reference"):  # a kernel the user names stays
        assert kernels(task_of(True, cls=cls, attention_impl=chosen), compiling=True) == {chosen}


def test_auto_resolves_to_blockwise_inside_a_compiled_graph():
    """``resolve`` reads the tracer's state: the compiled function took the blockwise branch."""

    def which(x: torch.Tensor) -> torch.Tensor:
        return x + (1.0 if resolve("auto") == "blockwise" else 0.0)

    x = torch.zeros(2)
    assert which(x).tolist() == [0.0, 0.0]  # eager: chunked
    assert torch.compile(which, backend="eager")(x).tolist() == [1.0, 1.0]


def test_compile_keeps_the_parameters_and_the_checkpoint_spec():
    eager, compiled = task_of(False), task_of(True)
    assert eager.state_dict().keys() == compiled.state_dict().keys()
    for key, value in eager.state_dict().items():
        assert torch.equal(compiled.state_dict()[key], value), key
    assert compiled.backbone_spec == eager.backbone_spec  # no attention_impl written in


def batches() -> list[dict[str, torch.Tensor]]:
    """Training batches whose longest history differs (the task trims each to it)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for rows, longest in ((4, 6), (3, 9), (5, 12), (4, L + 1)):
        seq = torch.randint(1, ITEMS + 1, (rows, L + 1), generator=g)
        seq[:, : L + 1 - longest] = 0  # left padding beyond the longest history
        seq[0, : L + 1 - longest // 2] = 0  # one shorter row
        out.append({"seq": seq})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("cls", [SASRec, HSTU])
def test_compiled_task_matches_eager_over_lengths_with_few_compiles(monkeypatch, cls):
    """Four batches of different lengths and sizes: the compiled task's losses and gradients
    are the eager task's (eager: the default chunked kernel; compiled: blockwise). The
    graph is built twice, by the first two steps (the first has no running-sill update
    pending, later ones have); the other lengths add no compile."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    eager, compiled = task_of(False, cls=cls, dropout=0.0), task_of(True, cls=cls, dropout=0.0)
    compiled.load_state_dict(eager.state_dict())
    frames = []
    for batch in batches():
        grads = []
        losses = []
        for task in (eager, compiled):
            task.zero_grad(set_to_none=True)
            loss = task.training_step(batch, 0)
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad for n, p in task.named_parameters() if p.grad is not None})
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        assert grads[0].keys() == grads[1].keys()
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)
        frames.append(counter.frame_count)
    assert frames[1] == frames[-1] <= 4, frames  # no compile after the second step
