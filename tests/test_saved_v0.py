"""Files saved before ``filter:`` and before the language model moved to ``bft_lightning.lm``
still load, and give the outputs they gave then (``tests/fixtures/make_saved_v0.py``
wrote them with that code, ``expected.pt`` holding its outputs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bft_lightning.lm.task import LanguageSFT
from bft_lightning.nn.filter import FilterConfig
from bft_lightning.serving.recommender import Recommender

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
    from bft_lightning.lm.model import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(SAVED / "lm_export")
    assert model.bft_state_loaded and model.bft.filter.attention_gate == "sigmoid"
    x = torch.arange(3, 21).view(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x).logits, expected()["lm_logits"])


def test_old_import_paths_give_the_moved_classes_with_a_warning() -> None:
    import importlib

    from bft_lightning.lm.data.qa import QADataModule
    from bft_lightning.lm.model import LlamaForCausalLM
    from bft_lightning.lm.task import LanguageSFT as Moved

    for old, name, new in [
        ("bft_lightning.models.llama", "LlamaForCausalLM", LlamaForCausalLM),
        ("bft_lightning.tasks.language", "LanguageSFT", Moved),
        ("bft_lightning.datamodules.qa.datamodule", "QADataModule", QADataModule),
    ]:
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to bft_lightning.lm"):
            module = importlib.import_module(old)
        assert getattr(module, name) is new


def test_old_language_model_config_parses_and_builds() -> None:
    """A config with the old class paths and flat BFT options builds the same classes."""
    import lightning as L
    from jsonargparse import ArgumentParser

    from bft_lightning.lm.data.synthetic_qa import SyntheticQADataModule

    parser = ArgumentParser()
    parser.add_subclass_arguments(L.LightningModule, "model")
    parser.add_subclass_arguments(L.LightningDataModule, "data")
    text = (SAVED / "lm_config.yaml").read_text(encoding="utf-8")
    built = parser.instantiate_classes(parser.parse_string(text))
    assert isinstance(built.model, LanguageSFT)
    assert isinstance(built.data, SyntheticQADataModule)
    assert built.model.model.bft.filter == FilterConfig(
        precision="on", q_init=0.02, attention_gate="sigmoid"
    )
