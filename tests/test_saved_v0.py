"""Files saved before ``filter:`` and before the language model moved to ``bft_lightning.lm``
still load, and give the outputs they gave then (``tests/fixtures/make_saved_v0.py``
wrote them with that code, ``expected.pt`` holding its outputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bft_lightning.nn.filter import FilterConfig
from bft_lightning.serving.recommender import Recommender
from bft_lightning.tasks.language import LanguageSFT

pytestmark = pytest.mark.usefixtures("one_thread")

SAVED = Path(__file__).parent / "fixtures" / "saved_v0"


def expected() -> dict[str, torch.Tensor]:
    return torch.load(SAVED / "expected.pt", weights_only=True)


def test_recommendation_checkpoint_with_flat_filter_options_loads() -> None:
    checkpoint = torch.load(SAVED / "rec_sasrec_on.ckpt", weights_only=True)
    init = checkpoint["bft_lightning"]["backbone_init"]["init_args"]
    assert init["q_init"] == 0.02 and "filter" not in init  # saved in the flat form
    model = Recommender.from_checkpoint(SAVED / "rec_sasrec_on.ckpt").model
    assert model.filter == FilterConfig(precision="on", q_init=0.02, nu0=2.0)
    ids = torch.tensor([[0, 0, 3, 5, 7, 9, 11, 2], [1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        h, lp = model.eval().last_hidden(ids)
        torch.testing.assert_close(model.score(h, lp), expected()["rec_scores"])


def test_language_model_lightning_checkpoint_with_flat_options_loads() -> None:
    checkpoint = torch.load(SAVED / "lm_sft.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["bft"]["q_init"] == 0.02  # flat
    task = LanguageSFT.load_from_checkpoint(SAVED / "lm_sft.ckpt", weights_only=True)
    assert task.model.bft.filter == FilterConfig(
        precision="on", q_init=0.02, attention_gate="sigmoid", attention_impl="chunked"
    )
    x = torch.arange(3, 21).view(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(task.model.eval()(x).logits, expected()["lm_logits"])


def test_language_model_export_with_flat_options_loads() -> None:
    assert json.loads((SAVED / "lm_export" / "bft_options.json").read_text())["q_init"] == 0.02
    from bft_lightning.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(SAVED / "lm_export")
    assert model.bft_state_loaded and model.bft.filter.attention_gate == "sigmoid"
    x = torch.arange(3, 21).view(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x).logits, expected()["lm_logits"])
