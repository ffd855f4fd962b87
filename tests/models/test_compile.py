"""torch.compile on CPU: a compiled BFT model gives the eager model's loss and gradients."""

from __future__ import annotations

import pytest
import torch

from bft_lightning.models import SASRec


def _loss(model: SASRec, ids: torch.Tensor) -> torch.Tensor:
    hidden, log_prec = model.encode(ids)
    logits = model.score(hidden[:, -1], None if log_prec is None else log_prec[:, -1])
    return torch.nn.functional.cross_entropy(logits, ids[:, -1]) + hidden.square().mean()


@pytest.mark.parametrize(
    "precision, impl",
    [
        ("on", "chunked"),
        pytest.param("on", "reference", marks=pytest.mark.slow),
        pytest.param("off", "chunked", marks=pytest.mark.slow),
    ],
)
def test_compiled_model_matches_eager(precision, impl, compiled_matches_eager):
    torch.manual_seed(0)
    model = SASRec(
        40, max_len=10, d_model=16, nhead=2, num_layers=2, dim_feedforward=32, dropout=0.0,
        precision=precision, attention_impl=impl, attention_chunk=4,
        head="precision" if precision == "on" else "dot",
    )  # fmt: skip
    ids = torch.randint(1, 41, (4, 10))
    ids[0, :6] = 0  # left padding
    state = {k: v.clone() for k, v in model.state_dict().items()}
    eager_state = compiled_matches_eager(model, ids, _loss)
    # the running sill moved the same way in both (updated, not frozen, in training)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, eager_state[key])
    if precision == "on":
        assert not torch.equal(eager_state["encoder.layers.0.sill"], state["encoder.layers.0.sill"])
