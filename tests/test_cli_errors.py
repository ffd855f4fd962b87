"""The command line's error path: one ``error:`` line, exit code 2, no traceback.

``python -m bft_lightning`` is :func:`bft_lightning.cli.entry`; these tests
call it in this process (and once as a real subprocess). A bad CLI value, a
bad config value or file, a missing, truncated or bit-flipped checkpoint each
end with exactly one line on stderr that names the option, file or field;
``--debug`` / ``BFT_DEBUG=1`` bring the traceback back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from bft_lightning.cli import entry, main
from bft_lightning.utils.errors import condense_parser_message

REPO = Path(__file__).resolve().parents[1]
SASREC = REPO / "configs" / "experiments" / "sasrec_on_synthetic.yaml"
TINY = [
    "--data.init_args.synthetic_users=300",
    "--data.init_args.max_len=12",
    "--model.init_args.backbone.init_args.d_model=16",
    "--model.init_args.backbone.init_args.dim_feedforward=32",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.logger=false",
]


def fails(capsys, args: list[str]) -> str:
    """Run ``entry(args)``; it must exit 2 with one stderr line and no traceback."""
    with pytest.raises(SystemExit) as stop:
        entry(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]), err[-3000:]
    return lines[0]


def fit(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(SASREC), *TINY, f"--trainer.default_root_dir={tmp_path}", *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint of the tiny set-up, written by the configs' AtomicCheckpointIO."""
    out = tmp_path_factory.mktemp("trained")
    L.seed_everything(0)
    cli = main(fit(out, "--trainer.max_steps=2", "--trainer.limit_val_batches=0"))
    path = out / "model.ckpt"
    cli.trainer.save_checkpoint(path)
    return path


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("--data.init_args.max_len=abc", "error: --data.init_args.max_len: Expected a <class"),
        ("--trainer.max_epochs=x", "error: --trainer.max_epochs: Expected a <class 'int'>. Got"),
        (
            "--model.init_args.backbone.init_args.d_model=zz",
            "error: --model.init_args.backbone.init_args.d_model: Expected a <class 'int'>",
        ),
        ("--model.init_args.no_such_option=1", "no_such_option"),
        ("--trainer.callbacks+=NoSuchCallback", "NoSuchCallback"),
    ],
)  # fmt: skip
def test_a_bad_cli_value_is_one_line_naming_the_option(capsys, tmp_path, arg, expected):
    line = fails(capsys, fit(tmp_path, arg))
    assert expected in line
    assert not (tmp_path / "checkpoints").exists()


def test_a_value_refused_by_the_model_is_one_line(capsys, tmp_path):
    line = fails(capsys, fit(tmp_path, "--model.init_args.lr=-1"))
    assert line == "error: lr must be >= 0, got -1.0"


def test_a_bad_config_value_is_one_line(capsys, tmp_path):
    config = tmp_path / "neg.yaml"
    config.write_text("model:\n  init_args:\n    loss: hinge\n")
    line = fails(capsys, fit(tmp_path, "--config", str(config)))
    assert "loss must be one of" in line and "'hinge'" in line


def test_a_config_that_is_not_yaml_names_file_and_line(capsys, tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("model:\n  init_args:\n    lr: [1\n")
    line = fails(capsys, fit(tmp_path, "--config", str(config)))
    assert f"{config}: line 4" in line and "starts at line 3" in line


def test_a_missing_config_is_named(capsys, tmp_path):
    line = fails(capsys, ["fit", "--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in line


def test_a_bad_data_file_is_named(capsys, tmp_path):
    data = tmp_path / "seq.txt"
    data.write_text("1 2 3\n4 x 6\n")
    args = fit(tmp_path, f"--data.init_args.path={data}")
    line = fails(capsys, args)
    assert str(data) in line


# ----------------------------------------------------------------------------- checkpoints
def test_a_missing_checkpoint_is_named(capsys, tmp_path):
    line = fails(capsys, fit(tmp_path, f"--ckpt_path={tmp_path / 'gone.ckpt'}"))
    assert line == f"error: --ckpt_path checkpoint not found: {tmp_path / 'gone.ckpt'}"


def test_a_truncated_checkpoint_is_named(capsys, tmp_path, trained):
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(trained.read_bytes()[: trained.stat().st_size // 2])
    line = fails(capsys, ["test", *fit(tmp_path)[1:], f"--ckpt_path={cut}"])
    assert f"{cut}: not a complete PyTorch checkpoint" in line


def test_a_checkpoint_with_one_flipped_bit_is_refused(capsys, tmp_path, trained):
    """torch.load reads such a file without complaint; the digest does not."""
    weight = torch.load(trained, weights_only=True)["state_dict"]["model.item_emb.weight"]
    data = bytearray(trained.read_bytes())
    at = data.find(weight.numpy().tobytes()[:64])
    assert at > 0
    data[at + 4 * 200 + 1] ^= 0x04  # one bit of one weight
    flipped = tmp_path / "flipped.ckpt"
    flipped.write_bytes(bytes(data))
    torch.load(flipped, weights_only=True)  # loads silently
    line = fails(capsys, ["test", *fit(tmp_path)[1:], f"--ckpt_path={flipped}"])
    assert f"{flipped}: content digest mismatch" in line


def test_test_with_best_and_no_run_is_an_error_not_an_untrained_model(capsys, tmp_path):
    args = ["test", "--config", str(SASREC), *TINY[:-1]]
    args += [f"--trainer.logger.init_args.save_dir={tmp_path}"]
    line = fails(capsys, [*args, "--ckpt_path=best"])
    assert "no checkpoint found" in line and str(tmp_path) in line


# ----------------------------------------------------------------------------- debug
def test_debug_flag_and_env_show_the_traceback(capsys, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="lr must be >= 0"):
        entry([*fit(tmp_path, "--model.init_args.lr=-1"), "--debug"])
    monkeypatch.setenv("BFT_DEBUG", "1")
    with pytest.raises(ValueError, match="lr must be >= 0"):
        entry(fit(tmp_path, "--model.init_args.lr=-1"))


# ----------------------------------------------------------------------------- help
def test_help_names_the_program_and_leads_with_what_matters(capsys):
    with pytest.raises(SystemExit) as stop:
        entry(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m bft_lightning ")
    assert "__main__" not in out
    with pytest.raises(SystemExit):
        entry(["fit", "--help"])
    head = capsys.readouterr().out.splitlines()[:16]
    assert head[0].startswith("usage: python -m bft_lightning fit --config")
    lead = "\n".join(head)
    assert "The options that matter most" in lead
    assert "--ckpt_path last" in lead and "--debug" in lead


def test_condensed_parser_message_keeps_the_deepest_complaint():
    message = (
        'Parser key "data":\n  Does not validate against any of the Union subtypes\n'
        "  Errors:\n    - Problem with given class_path 'x.DataModule':\n"
        "        Parser key \"batch_size\":\n          Expected a <class 'int'>. Got value: q\n"
        "    - Expected a <class 'NoneType'>\n  Given value: NestedArg(key='batch_size', val='q')"
    )
    assert condense_parser_message(message) == (
        "--data.init_args.batch_size: Expected a <class 'int'>. Got value: q"
    )


def test_the_real_command_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("BFT_DEBUG", None)
    cmd = [sys.executable, "-m", "bft_lightning", *fit(tmp_path, "--trainer.max_epochs=x")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "error: --trainer.max_epochs: Expected a <class 'int'>. Got value: x"
    ]
