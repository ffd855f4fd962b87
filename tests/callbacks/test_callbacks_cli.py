"""Every callback's signature works with LightningCLI's parser (jsonargparse), with help text."""

import pytest
from jsonargparse import ArgumentParser

from bft_lightning.callbacks import (
    AttentionSinkMonitor,
    GainByContextLength,
    GainByStratum,
    PrecisionMonitor,
)


@pytest.mark.parametrize(
    "cls, args, doc",
    [
        (PrecisionMonitor, ["--cb.every_n_steps=10", "--cb.layers=[0, 'encoder.*']",
                            "--cb.ranges={'n_eff': [0, 64]}"], "optimizer steps"),
        (AttentionSinkMonitor, ["--cb.eps=0.5", "--cb.stages=[validate]"], "threshold of"),
        (GainByContextLength, ["--cb.bucket_edges=[1, 8, 64]", "--cb.by=length"],
         "bucket edges"),
        (GainByStratum, ["--cb.item_key=target", "--cb.item_frequency=[0, 3, 1]"],
         "training count per item"),
    ],
)  # fmt: skip
def test_parse_and_instantiate(cls, args, doc):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "cb")
    assert doc in " ".join(parser.format_help().split())  # Args: docs become --help
    cfg = parser.parse_args(args)
    cb = parser.instantiate_classes(cfg).cb
    assert isinstance(cb, cls)


def test_parsed_values_reach_the_callback():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(PrecisionMonitor, "cb")
    cfg = parser.parse_args(["--cb.every_n_steps=7", "--cb.ranges={'n_eff': [0, 64]}"])
    cb = parser.instantiate_classes(cfg).cb
    assert cb.every_n_steps == 7 and (cb.bins["n_eff"].lo, cb.bins["n_eff"].hi) == (0.0, 64.0)
