"""CUDA: the same numbers as on CPU, the memory-bounded path, mixed precision, compile.

Skipped without a CUDA device (CI has none); run them where one exists with
``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch

from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.nn.attention import build_allowed, reference_attention
from bft_lightning.nn.chunked import _ChunkedKriging, chunked_attention
from bft_lightning.tasks import SequentialRecommendation

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODELS = {"sasrec": SASRec, "bert4rec": BERT4Rec, "hstu": HSTU}


@pytest.fixture(autouse=True)
def _exact_float32():
    """Compare float32 results without TF32 rounding in the matrix products."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _kriging_inputs(b, h, t, dh, causal, device, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, dh, generator=g, dtype=dtype) for _ in range(3))
    bias = torch.randn(b, h, t, generator=g, dtype=dtype)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, : t // 3] = False  # left padding
    allowed = build_allowed(valid, causal)
    return [x.to(device) for x in (q, k, v, bias, allowed)]


def _outputs(out, stats):
    parts = (out, stats.estimate, stats.second_moment, stats.sum_p_sq)
    return torch.cat([x.flatten() for x in parts])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t, chunk", [(7, 3), (64, 16), (300, 256)])
def test_chunked_equals_reference_on_cuda(causal, t, chunk):
    q, k, v, bias, allowed = _kriging_inputs(2, 2, t, 8, causal, "cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    parts = chunked_attention(*leaves[:3], allowed, leaves[3], 0.0, chunk)
    got = torch.cat([x.flatten() for x in parts])
    ref_out, _, ref_stats = reference_attention(*ref_leaves[:3], allowed, ref_leaves[3], 0.0, True)
    want = _outputs(ref_out, ref_stats)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    w = torch.randn_like(got)
    grads = torch.autograd.grad((got * w).sum(), leaves)
    ref_grads = torch.autograd.grad((want * w).sum(), ref_leaves)
    for name, a, r in zip("qkvb", grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-10, msg=f"grad of {name}")


def test_chunked_gradcheck_with_dropout_on_cuda():
    """The backward regenerates the forward's dropout mask from a CUDA generator."""
    q, k, v, bias, allowed = _kriging_inputs(2, 2, 6, 3, True, "cuda")
    args = [x.requires_grad_() for x in (q, k, v, bias)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: _ChunkedKriging.apply(q, k, v, b, allowed, 0.3, 4, 1234, False),
        args,
    )


@pytest.mark.parametrize("backbone", sorted(MODELS))
@pytest.mark.parametrize("precision", ["off", "on"])
def test_model_on_cuda_equals_cpu(backbone, precision):
    """Loss and gradients of a whole recommender agree between CPU and CUDA (float64)."""
    torch.manual_seed(0)
    kw = {} if backbone == "hstu" else {"attention_chunk": 4}
    model = MODELS[backbone](
        50, max_len=12, d_model=16, nhead=2, num_layers=2, dropout=0.0, precision=precision, **kw
    ).double()
    ids = torch.randint(1, 51, (5, 12))
    ids[0, :7] = 0

    def loss_and_grads(m, x):
        hidden, log_prec = m.encode(x)
        lp = None if log_prec is None else log_prec[:, -1]
        loss = torch.nn.functional.cross_entropy(m.score(hidden[:, -1], lp), x[:, -1])
        params = [p for p in m.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return loss.detach().cpu(), [None if g is None else g.cpu() for g in grads]

    state = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_loss, cpu_grads = loss_and_grads(model, ids)
    model.load_state_dict(state)
    cuda_loss, cuda_grads = loss_and_grads(model.cuda(), ids.cuda())
    torch.testing.assert_close(cuda_loss, cpu_loss, rtol=1e-10, atol=1e-12)
    for a, b in zip(cuda_grads, cpu_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backbone", sorted(MODELS))
def test_autocast_on_cuda_is_finite_and_close(backbone, dtype):
    torch.manual_seed(0)
    model = MODELS[backbone](200, max_len=50, d_model=64, nhead=2, num_layers=2, precision="on")
    model = model.cuda().eval()
    ids = torch.randint(1, 201, (32, 50), device="cuda")
    ids[:8, :30] = 0

    def loss_of():
        hidden, log_prec = model.encode(ids)
        logits = model.score(hidden[:, -1], log_prec[:, -1])
        return torch.nn.functional.cross_entropy(logits.float(), ids[:, -1])

    exact = loss_of()
    with torch.autocast("cuda", dtype=dtype):
        mixed = loss_of()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(mixed, params, allow_unused=True)
    assert torch.isfinite(mixed)
    assert all(torch.isfinite(g).all() for g in grads if g is not None)
    torch.testing.assert_close(mixed, exact, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("backbone", sorted(MODELS))
def test_compiled_model_on_cuda_matches_eager(backbone, compiled_matches_eager):
    """Inductor on CUDA once gave zero gradients through the filter's hand-written
    autograd Functions; under compile the filter now uses plain formulas."""
    torch.manual_seed(0)
    kw = {} if backbone == "hstu" else {"attention_chunk": 8}
    model = MODELS[backbone](
        60, max_len=16, d_model=32, nhead=2, num_layers=2, dropout=0.0, precision="on",
        head="precision", **kw,
    ).cuda()  # fmt: skip
    ids = torch.randint(1, 61, (8, 16), device="cuda")
    ids[0, :9] = 0

    def loss(m, x):
        hidden, log_prec = m.encode(x)
        logits = m.score(hidden[:, -1], log_prec[:, -1])
        return torch.nn.functional.cross_entropy(logits, x[:, -1])

    compiled_matches_eager(model, ids, loss)


@pytest.mark.parametrize("precision", ["off", "on"])
def test_training_on_gpu_beats_popularity(tmp_path, precision):
    """The Lightning task trains and evaluates (full ranking, strata) on the GPU."""
    torch.manual_seed(0)
    dm = SequenceDataModule(max_len=20, batch_size=128, synthetic_users=800, synthetic_items=200)
    task = SequentialRecommendation(
        dm.num_items, 20, backbone=partial(SASRec, precision=precision, d_model=32),
        lr=3e-3, report_dir=str(tmp_path / "report"),
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_epochs=6, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(task, dm)
    trainer.test(task, dm, verbose=False)
    got = task.test_results
    dm.setup("test")
    freq = dm.item_frequency.float()
    # popularity: rank of each test target among all items by training frequency
    targets = torch.cat([b["target"] for b in dm.test_dataloader()])
    pop_rank = (freq.unsqueeze(0) > freq[targets].unsqueeze(1)).sum(1)
    pop_ndcg = torch.where(pop_rank < 10, 1 / torch.log2(pop_rank + 2.0), 0.0).mean().item()
    assert got["ndcg@10"] > pop_ndcg + 0.05, (got["ndcg@10"], pop_ndcg)
    if precision == "on":
        assert 0 < got["gain"] < 1
