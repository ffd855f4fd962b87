"""Evaluation computes the last layer at the predicting position only: the same final
states, precisions, ranks and metrics as the whole computation, every backbone."""

from __future__ import annotations

import pytest
import torch

from bft_lightning.callbacks.recording import acquire, release, select_layers
from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.retrieval import target_ranks

N, L = 40, 12

CASES = [
    (SASRec, {}), (SASRec, {"gain": "head"}), (SASRec, {"attention_gate": "sigmoid"}),
    (SASRec, {"attention_impl": "reference"}), (SASRec, {"key_precision": False}),
    (BERT4Rec, {}), (BERT4Rec, {"gain": "head"}), (HSTU, {}),
]  # fmt: skip


def build(cls, precision: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    if precision == "off":
        kw = {k: v for k, v in kw.items() if k not in ("gain", "key_precision")}
    model = cls(N, L, d_model=16, nhead=2, num_layers=3, dim_feedforward=32, dropout=0.1,
                precision=precision, **kw)  # fmt: skip
    with torch.no_grad():  # a trained-looking model: varied weights, a visible time bias
        for name, p in model.named_parameters():
            if "time_weight" in name or "pos_weight" in name:
                p.normal_(0.0, 0.5)
    return model.eval()


def histories(b: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids of mixed lengths (one row of one item, one full) and times."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, N + 1, (b, L), generator=g)
    lengths = torch.tensor([1, 3, L, 5, 8, L - 1, 2])[:b]
    ids = ids * (torch.arange(L) >= L - lengths.unsqueeze(1))
    gaps = (10 ** (torch.rand(b, L, generator=g) * 6)).long()
    return ids, (1_600_000_000 + gaps.cumsum(1)) * (ids != 0)


@pytest.mark.parametrize(("cls", "kw"), CASES, ids=lambda c: getattr(c, "__name__", str(c)))
@pytest.mark.parametrize("precision", ["off", "on"])
def test_last_position_states_equal_the_full_computation(cls, kw, precision: str) -> None:
    model = build(cls, precision, **kw)
    ids, times = histories()
    t = times if cls is HSTU else None
    with torch.no_grad():
        full_h, full_lp = model.last_hidden(ids, t, last_only=False)
        last_h, last_lp = model.last_hidden(ids, t, last_only=True)
        default_h, _ = model.last_hidden(ids, t)  # eval mode: the short path
    assert last_h.shape == full_h.shape == (len(ids), 16)
    torch.testing.assert_close(last_h, full_h, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(default_h, last_h, rtol=0, atol=0)
    if precision == "on":
        assert last_lp is not None and full_lp is not None
        torch.testing.assert_close(last_lp, full_lp, rtol=1e-5, atol=2e-6)
    else:
        assert last_lp is None and full_lp is None
    # the same ranks of every item (the metrics' input), with and without the history
    target = torch.randint(1, N + 1, (len(ids),))
    for exclude in (None, ids):
        a = target_ranks(model, full_h, full_lp, target, exclude)
        b = target_ranks(model, last_h, last_lp, target, exclude)
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", [SASRec, HSTU])
def test_padding_leaves_the_last_position_unchanged(cls) -> None:
    """A batch padded wider gives the same short-path states (padding invariance)."""
    model = build(cls, "on")
    ids, times = histories()
    ids, times = ids[:, 3:], times[:, 3:]  # L - 3 columns; then 3 more of padding
    pad = torch.zeros(len(ids), 3, dtype=torch.long)
    wide, wide_t = torch.cat([pad, ids], 1), torch.cat([pad, times], 1)
    t, wt = (times, wide_t) if cls is HSTU else (None, None)
    with torch.no_grad():
        a, _ = model.last_hidden(ids, t)
        b, _ = model.last_hidden(wide, wt)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_training_mode_and_recording_callbacks_run_every_position() -> None:
    model = build(SASRec, "on")
    ids, _ = histories()
    last = list(model.encoder.layers)[-1]
    layers = select_layers(model, None, "test")
    owner = object()
    acquire(layers, owner)  # a callback reading every position's statistics
    try:
        with torch.no_grad():
            model.last_hidden(ids)
        assert last.last_stats is not None and last.last_stats.gain.shape[1] == L
    finally:
        release(layers, owner)
    assert not last.record_all_positions
    last.record = True  # the task's own recording (the gain at the predicting position)
    with torch.no_grad():
        model.last_hidden(ids)
    assert last.last_stats is not None and last.last_stats.gain.shape[1] == 1
    last.record = False
    model.train()
    torch.manual_seed(0)
    h, _ = model.last_hidden(ids, last_only=True)  # falls back to the whole layer
    assert h.shape == (len(ids), 16) and h.requires_grad


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec, HSTU])
def test_bf16_autocast_short_path_matches(cls) -> None:
    model = build(cls, "on")
    ids, times = histories()
    t = times if cls is HSTU else None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, lp_a = model.last_hidden(ids, t, last_only=False)
        b, lp_b = model.last_hidden(ids, t, last_only=True)
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lp_a, lp_b, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls", [SASRec, BERT4Rec, HSTU])
@pytest.mark.parametrize("precision", ["off", "on"])
def test_cuda_short_path_matches(cls, precision: str) -> None:
    model = build(cls, precision).cuda()
    ids, times = (x.cuda() for x in histories())
    t = times if cls is HSTU else None
    with torch.no_grad():
        a, lp_a = model.last_hidden(ids, t, last_only=False)
        b, lp_b = model.last_hidden(ids, t, last_only=True)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if precision == "on":
        torch.testing.assert_close(lp_a, lp_b, rtol=1e-4, atol=1e-5)
