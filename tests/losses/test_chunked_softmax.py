"""The chunked cross-entropy equals the full softmax (values and gradients) and its
memory does not grow with the catalogue."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bft_lightning.losses import ChunkedSoftmax, FullSoftmax, build_loss, chunked_cross_entropy
from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.tasks import SequentialRecommendation

BACKBONES = {
    "sasrec_dot": partial(SASRec),
    "sasrec_precision_head": partial(SASRec, precision="on", head="precision"),
    "bert4rec_bias": partial(BERT4Rec),
    "hstu": partial(HSTU),
}


def _model(name: str, num_items: int, d: int, dtype: torch.dtype) -> torch.nn.Module:
    model = BACKBONES[name](num_items, 8, d_model=d, dropout=0.0).to(dtype)
    with torch.no_grad():  # non-trivial head parameters: a bias, a per-row temperature
        if hasattr(model, "temperature"):
            model.temperature.weight.normal_(std=0.5)
            model.temperature.bias.normal_(std=0.3)
        if hasattr(model, "out_bias"):
            model.out_bias.normal_(std=0.5)
        model.item_emb.weight.normal_(std=0.5)
    return model


def _inputs(model, n: int, dtype: torch.dtype, gen: torch.Generator):
    d = model.d_model
    hidden = torch.randn(n, d, dtype=dtype, generator=gen).requires_grad_()
    log_prec = None
    if model.precision == "on":
        log_prec = torch.randn(n, model.groups, dtype=dtype, generator=gen).requires_grad_()
    target = torch.randint(1, model.num_items + 1, (n,), generator=gen)
    return hidden, target, log_prec


def _value_and_grads(loss_fn, model, hidden, target, log_prec):
    wrt = [hidden] + ([log_prec] if log_prec is not None else [])
    wrt += [p for p in model.parameters() if p.requires_grad]
    value = loss_fn(model, hidden, target, log_prec)
    grads = torch.autograd.grad(value, wrt, allow_unused=True)
    return value, grads


def _exact(model, hidden, target, log_prec):
    """Today's full softmax in the inputs' dtype (``FullSoftmax`` casts logits to float32)."""
    return F.cross_entropy(model.score(hidden, log_prec), target)


@pytest.mark.parametrize("name", list(BACKBONES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_equals_full_float64(name: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_items = int(torch.randint(5, 300, (1,), generator=gen))
    n = int(torch.randint(1, 40, (1,), generator=gen))
    chunk = int(torch.randint(1, num_items + 10, (1,), generator=gen))  # rarely divides
    model = _model(name, num_items, 16, torch.float64)
    hidden, target, log_prec = _inputs(model, n, torch.float64, gen)
    want, want_grads = _value_and_grads(_exact, model, hidden, target, log_prec)
    got, got_grads = _value_and_grads(ChunkedSoftmax(chunk), model, hidden, target, log_prec)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert sum(g is not None for g in want_grads) >= 2  # hidden, item embedding, ...
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_gradients_reach_bias_and_temperature() -> None:
    """The head's own parameters get the full softmax's gradients (not only zeros)."""
    gen = torch.Generator().manual_seed(3)
    for name, param in (("bert4rec_bias", "out_bias"), ("sasrec_precision_head", "temperature")):
        model = _model(name, 50, 8, torch.float64)
        hidden, target, log_prec = _inputs(model, 12, torch.float64, gen)
        module = getattr(model, param)
        p = module if isinstance(module, torch.nn.Parameter) else module.weight
        want = torch.autograd.grad(_exact(model, hidden, target, log_prec), p)[0]
        got = torch.autograd.grad(ChunkedSoftmax(7)(model, hidden, target, log_prec), p)[0]
        assert want.abs().max() > 1e-3
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_tied_logits_and_chunk_of_one() -> None:
    """All items tied (zero states) and chunks of one item: log(num_items) exactly."""
    model = _model("sasrec_dot", 30, 8, torch.float64)
    hidden = torch.zeros(4, 8, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1, 7, 30, 7])
    for chunk in (1, 4, 31, 1000):
        value = ChunkedSoftmax(chunk)(model, hidden, target, None)
        torch.testing.assert_close(value, torch.tensor(30.0, dtype=torch.float64).log())
        grad = torch.autograd.grad(value, hidden)[0]
        want = torch.autograd.grad(_exact(model, hidden, target, None), hidden)[0]
        torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)


def test_float32_matches_full_softmax() -> None:
    gen = torch.Generator().manual_seed(4)
    for name in BACKBONES:
        model = _model(name, 1000, 32, torch.float32)
        hidden, target, log_prec = _inputs(model, 64, torch.float32, gen)
        want, want_grads = _value_and_grads(FullSoftmax(), model, hidden, target, log_prec)
        got, got_grads = _value_and_grads(ChunkedSoftmax(96), model, hidden, target, log_prec)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(got_grads, want_grads, strict=True):
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_function_without_bias_or_scale_and_big_logits() -> None:
    """The online logsumexp is stable where a naive sum of exponentials overflows."""
    gen = torch.Generator().manual_seed(5)
    h = (100 * torch.randn(9, 4, dtype=torch.float64, generator=gen)).requires_grad_()
    w = torch.randn(20, 4, dtype=torch.float64, generator=gen).requires_grad_()
    t = torch.randint(1, 20, (9,), generator=gen)
    logits = h @ w.t()
    logits = torch.cat([torch.full_like(logits[:, :1], float("-inf")), logits[:, 1:]], 1)
    want = F.cross_entropy(logits, t)
    got = chunked_cross_entropy(h, w, t, chunk=3)
    assert torch.isfinite(got) and want > 100
    torch.testing.assert_close(got, want)
    for g, e in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(g, e)


class _LargestTensors(TorchDispatchMode):
    """Records the size of every tensor an operator returns (forward and backward)."""

    def __init__(self, skip_shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.skip, self.largest = skip_shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and tuple(t.shape) not in self.skip:
                self.largest = max(self.largest, t.numel())
        return out


def _largest_intermediate(loss_fn, num_items: int, n: int = 64, d: int = 8) -> int:
    """Elements of the largest tensor made by forward + backward, leaving out tensors
    of a parameter's shape (the item weights' gradient, which every loss makes)."""
    torch.manual_seed(0)
    model = SASRec(num_items, 8, d_model=d)
    hidden = torch.randn(n, d, requires_grad=True)
    target = torch.randint(1, num_items + 1, (n,))
    skip = {tuple(p.shape) for p in model.parameters()} | {(num_items + 1, d), (num_items + 1,)}
    with _LargestTensors(skip) as mode:
        loss_fn(model, hidden, target, None).backward()
    return mode.largest


def test_peak_memory_does_not_grow_with_items() -> None:
    n, chunk = 64, 128
    chunked = [_largest_intermediate(ChunkedSoftmax(chunk), v, n) for v in (1_000, 8_000)]
    assert chunked[0] == chunked[1] <= n * chunk, chunked
    full = [_largest_intermediate(FullSoftmax(), v, n) for v in (1_000, 8_000)]
    assert full == [n * 1_001, n * 8_001]  # the check sees the full softmax's logits


def test_task_ce_chunked_is_the_task_ce() -> None:
    """The task with ``loss="ce_chunked"`` trains on the same loss and gradients."""
    batch = {"seq": torch.randint(0, 41, (6, 9))}
    out = {}
    for loss in ("ce", "ce_chunked"):
        torch.manual_seed(0)
        backbone = partial(SASRec, d_model=16, dropout=0.0, precision="on", head="precision")
        task = SequentialRecommendation(40, 8, backbone=backbone, loss=loss, loss_chunk=7)
        value = task.training_step(batch, 0)
        grads = torch.autograd.grad(value, [p for p in task.parameters() if p.requires_grad])
        out[loss] = (value, grads)
    torch.testing.assert_close(out["ce_chunked"][0], out["ce"][0], rtol=1e-6, atol=1e-6)
    for g, w in zip(out["ce_chunked"][1], out["ce"][1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss_chunk": 0}, "loss_chunk must be an integer >= 1, got 0"),
        ({"negatives": "hard"}, "negatives must be one of"),
        ({"popularity_alpha": -1.0}, "popularity_alpha must be a finite number >= 0"),
        ({"num_negatives": 0}, "num_negatives must be an integer >= 1"),
    ],
)
def test_options_are_checked(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SequentialRecommendation(40, 8, **options)
    with pytest.raises(ValueError, match="loss must be one of"):
        build_loss("hinge", 40)
