"""The command line: every shipped YAML parses; fit runs for each backbone x precision."""

from __future__ import annotations

from pathlib import Path

import pytest

from bft_lightning.cli import BFTCLI, main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXPERIMENTS = sorted((CONFIGS / "experiments").glob("*.yaml"))


class ParseOnly(BFTCLI):
    """Parses and validates a config, instantiating nothing (no data is read)."""

    def instantiate_classes(self) -> None:
        pass


def parse(args: list[str]) -> ParseOnly:
    return ParseOnly(
        subclass_mode_model=True, subclass_mode_data=True, args=args, run=False,
        save_config_kwargs={"overwrite": True},
    )  # fmt: skip


@pytest.mark.parametrize("config", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_experiment_config_parses(config: Path) -> None:
    cli = parse(["--config", str(config)])
    assert cli.config["model"]["class_path"].startswith("bft_lightning.tasks.")


@pytest.mark.parametrize(
    "config", sorted(p for p in CONFIGS.glob("*/*.yaml") if p.parent.name != "experiments"),
    ids=lambda p: f"{p.parent.name}/{p.stem}",
)  # fmt: skip
def test_every_part_config_parses(config: Path) -> None:
    key = {"model": "--model", "data": "--data", "trainer": "--trainer"}.get(config.parent.name)
    if key is None:
        pytest.skip(f"{config} is not a model/data/trainer part")
    base = ["--model", "bft_lightning.tasks.SequentialRecommendation", "--data",
            "bft_lightning.datamodules.SequenceDataModule"]  # fmt: skip
    parse([*base, key, str(config)])


def test_wrong_key_is_named(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["--config", str(EXPERIMENTS[0]), "--model.init_args.no_such_option=1"])
    assert "no_such_option" in capsys.readouterr().err


@pytest.mark.parametrize("backbone", ["sasrec", "bert4rec", "hstu"])
@pytest.mark.parametrize("precision", ["off", "on"])
def test_fit_fast_dev_run(tmp_path, backbone: str, precision: str) -> None:
    cfg = CONFIGS / "experiments" / f"{backbone}_{precision}_synthetic.yaml"
    cli = main(
        ["fit", "--config", str(cfg), "--trainer.fast_dev_run=2",
         f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
         "--data.init_args.synthetic_users=300", "--data.init_args.max_len=12"],
    )  # fmt: skip
    assert cli.model.num_items == cli.datamodule.num_items  # linked, not typed twice
    assert cli.model.model.max_len == 12


def test_launch_mismatch_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="world size"):
        main(["--config", str(EXPERIMENTS[0]), "--trainer.devices=1"], run=False)


def test_console_script_exits_zero_after_a_run(tmp_path) -> None:
    """The installed ``bft-lightning`` script is ``sys.exit(<entry point>())``: the entry
    point must return None (an object would make every successful run exit 1)."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "bft-lightning"]
    cfg = CONFIGS / "experiments" / "sasrec_off_synthetic.yaml"
    code = f"import sys; from {ep.module} import {ep.attr} as f; sys.exit(f())"
    args = ["fit", "--config", str(cfg), "--trainer.fast_dev_run=1", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}", "--data.init_args.synthetic_users=300",
            "--data.init_args.max_len=12"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_quickstart_runs_from_any_directory(tmp_path) -> None:
    """``make quickstart``'s module, one epoch: both runs, then the side-by-side table;
    the configs are found from another working directory, and its own arguments do
    not reach the CLI (no LightningCLI warning about both)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "bft_lightning.quickstart", "--max-epochs", "1"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "precision off vs on" in done.stdout and "item_q0" in done.stdout
    assert "both args and command line arguments" not in done.stderr
