"""The recommenders' typed FilterConfig: the flat options' equal, read from YAML."""

from __future__ import annotations

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser

from bft_lightning.models import HSTU, SASRec
from bft_lightning.nn.filter import FilterConfig

FLAT = dict(precision="on", groups=4, q_init=0.02, nu0=2.0, attention_chunk=4)


@pytest.mark.parametrize("cls", [SASRec, HSTU])
def test_filter_config_equals_the_flat_options(cls) -> None:
    config = FilterConfig(precision="on", groups=4, q_init=0.02, nu0=2.0, attention_chunk=4)
    models = []
    for kwargs in (FLAT, {"filter": config}):
        torch.manual_seed(0)
        models.append(cls(30, max_len=8, d_model=16, nhead=2, num_layers=2, **kwargs))
    flat, typed = models
    assert flat.filter == typed.filter == config
    assert flat.state_dict().keys() == typed.state_dict().keys()
    for key, value in flat.state_dict().items():
        torch.testing.assert_close(typed.state_dict()[key], value, msg=key)
    ids = torch.randint(1, 31, (3, 8))
    ids[0, :3] = 0
    for a, b in zip(flat.eval().encode(ids), typed.eval().encode(ids), strict=True):
        torch.testing.assert_close(b, a)
    layers = list(typed.encoder.layers)
    assert [layer.q_init for layer in layers] == [0.02, 0.02]
    assert not layers[-1].predict_noise  # dot head: the model sets it on the last layer


def test_both_forms_at_once_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="^q_init: give the filter options either"):
        SASRec(30, q_init=0.5, filter=FilterConfig(precision="on"))
    with pytest.raises(ValueError, match="^gain must be one of"):
        SASRec(30, gain="token")


def test_jsonargparse_reads_the_config_from_yaml() -> None:
    parser = ArgumentParser()
    parser.add_class_arguments(SASRec, "model")
    text = """
    model:
      num_items: 30
      max_len: 8
      d_model: 16
      filter:
        precision: "on"
        groups: 4
        backward: autograd
    """
    cfg = parser.parse_object(yaml.safe_load(text))
    model = parser.instantiate_classes(cfg).model
    assert model.filter == FilterConfig(precision="on", groups=4, backward="autograd")
    assert all(layer.backward == "autograd" for layer in model.encoder.layers)
    bad = yaml.safe_load(text.replace("groups: 4", "groups: 0"))
    with pytest.raises((ValueError, SystemExit)):
        parser.instantiate_classes(parser.parse_object(bad))
