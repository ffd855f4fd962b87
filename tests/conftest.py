"""Shared test set-up: small thread counts, deterministic seeds, the data root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lm_fixtures import hf_checkpoint, hf_model, one_thread  # noqa: F401 (shared fixtures)

torch.set_num_threads(min(2, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parents[1]
DATA_ROOT = Path(os.environ.get("BFT_DATA_ROOT", REPO.parent / "shared" / "data"))
# the library's own default is ./data: the tests (and the commands they start) read the shared sets
os.environ.setdefault("BFT_DATA_ROOT", str(DATA_ROOT))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def data_root() -> Path:
    """The shared real datasets; tests that need them skip when they are absent."""
    if not DATA_ROOT.is_dir():
        pytest.skip(f"real datasets not found at {DATA_ROOT} (set BFT_DATA_ROOT)")
    return DATA_ROOT


def _compiled_matches_eager(model: torch.nn.Module, ids: torch.Tensor, loss) -> dict:
    """One step of ``loss(model, ids)`` eager and under torch.compile from the same
    state: the loss and every gradient agree. Returns the state after the eager step."""
    params = list(model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    eager = loss(model, ids)
    eager_grads = torch.autograd.grad(eager, params, allow_unused=True)
    eager_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # the same running sill for the compiled step
    compiled = torch.compile(loss)(model, ids)
    grads = torch.autograd.grad(compiled, params, allow_unused=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager_grads, strict=True):
        assert (g is None) == (e is None)
        if g is not None:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    return eager_state


@pytest.fixture
def compiled_matches_eager():
    """See :func:`_compiled_matches_eager`."""
    torch._dynamo.reset()
    return _compiled_matches_eager
