"""Every LM config parses (nothing is instantiated, so no checkpoint or data is read)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXPERIMENTS = sorted((CONFIGS / "experiments").glob("lm_*.yaml"))


class ParseOnly(LightningCLI):
    def instantiate_classes(self) -> None:
        pass


def parse(args: list[str]) -> ParseOnly:
    return ParseOnly(subclass_mode_model=True, subclass_mode_data=True, args=args, run=False)


def test_there_are_lm_experiments() -> None:
    names = {p.stem for p in EXPERIMENTS}
    assert {"lm_cpu_pretrain", "lm_tinyllama_squad_bft", "lm_cpu_squad_bft"} <= names


@pytest.mark.parametrize("config", EXPERIMENTS, ids=lambda p: p.stem)
def test_lm_experiment_parses(config: Path) -> None:
    cli = parse(["--config", str(config)])
    assert cli.config["model"]["class_path"] == "bft_lightning.lm.task.LanguageSFT"
    assert cli.config["data"]["class_path"].startswith("bft_lightning.lm.data.qa.")


def test_tinyllama_overrides() -> None:
    cli = parse([
        "--config", str(CONFIGS / "experiments" / "lm_tinyllama_squad_bft.yaml"),
        "--model.init_args.checkpoint_dir=/models/tl", "--data.init_args.noise_rate=0.4",
    ])  # fmt: skip
    init = cli.config["model"]["init_args"]
    assert init["checkpoint_dir"] == "/models/tl" and init["bft"]["filter"]["precision"] == "on"
    assert cli.config["data"]["init_args"]["noise_rate"] == 0.4
