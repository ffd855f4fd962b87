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
    assert cli.config["model"]["class_path"].startswith(
        ("bft_lightning.tasks.", "bft_lightning.lm.task.")
    )


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
    import os
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "bft-lightning"]
    cfg = CONFIGS / "experiments" / "sasrec_off_synthetic.yaml"
    code = f"import sys; from {ep.module} import {ep.attr} as f; sys.exit(f())"
    args = ["fit", "--config", str(cfg), "--trainer.fast_dev_run=1", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}", "--data.init_args.synthetic_users=300",
            "--data.init_args.max_len=12"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(CONFIGS.parent)}  # this checkout's package
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, env=env
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_quickstart_runs_from_any_directory(tmp_path) -> None:
    """``make quickstart``'s module, one epoch: both runs, then the one paired table and the
    figure; the configs are found from another working directory, its own arguments do
    not reach the CLI, and a run stopped by the epoch cap says it was cut short."""
    import os
    import subprocess
    import sys

    repo = CONFIGS.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bft_lightning.quickstart", "--max-epochs", "1"]
    cmd += ["--data.init_args.synthetic_users=400"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "precision off vs on" in out and "| item Q0 (rarest) |" in out
    table = [line for line in out.splitlines() if line.startswith("| overall |")]
    assert len(table) == 1 and " ± " in table[0] and "| 400 |" in table[0]  # n, paired SE
    for variant in ("off", "on"):
        assert f"precision={variant}: cut short: stopped at the cap max_epochs=1" in out
    assert (tmp_path / "logs" / "quickstart_sasrec_synthetic.png").is_file()
    runs = sorted((tmp_path / "logs" / "quick").iterdir())
    assert [(r / "gain_by_stratum_test.png").exists() for r in runs] == [False, True]  # BFT only
    assert "both args and command line arguments" not in done.stderr
    assert "Warning" not in done.stderr, done.stderr[-2000:]


def tiny_run(save_dir: Path) -> list[str]:
    cfg = CONFIGS / "experiments" / "sasrec_on_synthetic.yaml"
    return ["--config", str(cfg), f"--trainer.logger.init_args.save_dir={save_dir}",
            "--trainer.max_epochs=2", "--trainer.check_val_every_n_epoch=1",
            "--trainer.enable_model_summary=false", "--trainer.enable_progress_bar=false",
            "--data.init_args.synthetic_users=300", "--data.init_args.max_len=12",
            "--model.init_args.backbone.init_args.d_model=16"]  # fmt: skip


def test_fit_and_test_print_what_a_person_reads(tmp_path, capsys) -> None:
    """fit: a line per validation epoch, the stop reason, the best checkpoint's path;
    test: one table with four significant digits, written into the run's own folder;
    no warning from our code and none repeated."""
    import re
    import warnings

    from bft_lightning.cli import entry

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry(["fit", *tiny_run(tmp_path)])
        fit_out = capsys.readouterr().out
        entry(["test", *tiny_run(tmp_path), "--ckpt_path", "best"])
        test_out = capsys.readouterr().out
    lines = [line for line in fit_out.splitlines() if line.startswith("epoch ")]
    assert [line.split(" step")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    assert all("val NDCG@10 " in line and "mean K" in line for line in lines)
    run = tmp_path / "quick" / "version_0"
    assert "best checkpoint (val/ndcg@10 " in fit_out and str(run / "checkpoints") in fit_out
    assert "cut short" in fit_out
    assert sorted(p.name for p in (tmp_path / "quick").iterdir()) == ["version_0"]  # test too
    assert "Test metric" not in test_out  # Lightning's 100-row table is off
    overall = next(line for line in test_out.splitlines() if line.startswith("| overall |"))
    cells = overall.strip("|").split("|")[1:]
    assert all(re.fullmatch(r"0|\d+|\d\.\d{3}|0\.0*[1-9]\d{3}", c.strip()) for c in cells), overall
    assert (run / "metrics.md").read_text().count("| overall |") == 1
    assert (run / "config.yaml").is_file() and (run / "config_test.yaml").is_file()
    ours = [w for w in caught if "bft_lightning" in str(w.filename)]
    assert not ours, [str(w.message) for w in ours]
    messages = [str(w.message) for w in caught]
    assert len(messages) == len(set(messages)), messages
