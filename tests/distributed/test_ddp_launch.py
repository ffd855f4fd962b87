"""Distributed launches as they run in production, here on localhost CPUs.

Slow tier (subprocesses):

- two launcher processes with ``NODE_RANK`` 0 and 1, ``MASTER_ADDR=127.0.0.1``, a
  fixed port and ``num_nodes=2`` run the command of ``docker/compose.yaml``
  (``python -m bft_lightning fit ...``, the image's entry point);
- ``torchrun --nproc-per-node=2 -m bft_lightning fit ...``;
- both end with the same weights (one 2-process computation, two launchers),
  and with those of one process with twice the batch within tolerance (each
  process saw half of every global batch; see ``test_ddp_equivalence.py``);
- ``torchrun`` with ``devices`` that do not match its world size stops with a
  clear message instead of training twice.

Default tier: the launch checks that need no processes.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bft_lightning.cli import main
from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.utils import safe_load_checkpoint

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = REPO / "configs" / "experiments" / "sasrec_on_synthetic.yaml"
MAX_LEN, BATCH = 12, 32
TIMEOUT = 420  # seconds per launch; nothing may hang CI

LAUNCH_ENV = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_NTASKS",
    "PL_GLOBAL_SEED",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def compose_command() -> list[str]:
    """The ``command`` of ``docker/compose.yaml``'s nodes, with its defaults expanded."""
    spec = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    command = spec["x-node"]["command"]
    command = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m[1], m[2]), command)
    return shlex.split(command)


def even_users() -> int:
    """A synthetic user count whose training rows split evenly over 2 processes (no padding)."""
    for users in range(300, 320):
        dm = SequenceDataModule(max_len=MAX_LEN, synthetic_users=users)
        if len(dm._dataset("train")) % 2 == 0:
            return users
    raise AssertionError("no even split found")


def tiny(tmp: Path, users: int, batch: int) -> list[str]:
    return [
        f"--data.init_args.synthetic_users={users}",
        f"--data.init_args.max_len={MAX_LEN}",
        f"--data.init_args.batch_size={batch}",
        "--model.init_args.backbone.init_args.d_model=16",
        "--model.init_args.backbone.init_args.dim_feedforward=32",
        "--model.init_args.backbone.init_args.dropout=0.0",
        # the exact loss: a sampled one (the shipped SASRec's) draws other negatives on
        # each rank and takes each rank's own targets as in-batch candidates, so DDP and
        # one process would differ by design
        "--model.init_args.loss=ce",
        "--trainer.max_epochs=1",
        "--trainer.check_val_every_n_epoch=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={tmp}",
    ]


def run_all(commands: list[list[str]], envs: list[dict[str, str]], logs_dir: Path) -> list[str]:
    """Start every command at once, wait for all (with a timeout); return their output."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for k, (cmd, env) in enumerate(zip(commands, envs)):
        log = logs_dir / f"proc{k}.log"
        logs.append(log)
        with log.open("w") as fh:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=fh))
    try:
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [log.read_text() for log in logs]
    for code, out in zip(codes, outputs):
        assert code == 0, out[-4000:]
    return outputs


def last_weights(log_root: Path) -> tuple[dict[str, torch.Tensor], dict]:
    (ckpt,) = log_root.rglob("last.ckpt")
    checkpoint = safe_load_checkpoint(ckpt)
    return checkpoint["state_dict"], checkpoint


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_two_nodes_torchrun_and_one_process_train_the_same(tmp_path):
    users = even_users()
    rows = len(SequenceDataModule(max_len=MAX_LEN, synthetic_users=users)._dataset("train"))
    py = [sys.executable, "-m", "bft_lightning"]

    # 1. two "nodes" on localhost, exactly the Docker command (entry point python -m bft_lightning)
    nodes_dir = tmp_path / "nodes"
    port = str(free_port())
    cmd = [*py, *compose_command(), *tiny(nodes_dir, users, BATCH)]
    assert "--trainer.num_nodes=2" in cmd and "--trainer.devices=1" in cmd
    envs = [clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(r)) for r in (0, 1)]
    run_all([cmd, cmd], envs, tmp_path / "logs_nodes")
    nodes, nodes_ckpt = last_weights(nodes_dir)

    # 2. torchrun, 2 processes on one node
    run_dir = tmp_path / "torchrun"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "bft_lightning",
        "fit",
        "--config",
        str(EXPERIMENT),
        "--trainer",
        "configs/trainer/ddp_cpu.yaml",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
        *tiny(run_dir, users, BATCH),
    ]
    run_all([torchrun], [clean_env()], tmp_path / "logs_torchrun")
    torch_run, torch_ckpt = last_weights(run_dir)

    # 3. one process, twice the batch
    one_dir = tmp_path / "one"
    single = [
        *py,
        "fit",
        "--config",
        str(EXPERIMENT),
        "--trainer",
        "configs/trainer/ddp_cpu.yaml",
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        *tiny(one_dir, users, 2 * BATCH),
    ]
    run_all([single], [clean_env()], tmp_path / "logs_one")
    one, one_ckpt = last_weights(one_dir)

    steps = -(-rows // (2 * BATCH))
    assert nodes_ckpt["global_step"] == torch_ckpt["global_step"] == one_ckpt["global_step"]
    assert nodes_ckpt["global_step"] == steps  # each process saw half the rows, not all
    assert max_diff(nodes, torch_run) < 1e-6  # two launchers, one 2-process computation
    # one process, twice the batch: the same global batches and loss; the running sill
    # buffers (BatchNorm-like) follow rank 0's half of each batch under DDP, and AdamW
    # turns round-off into small steps, hence a tolerance (see test_ddp_equivalence.py)
    params = [k for k in one if not k.endswith(".sill")]
    assert max_diff({k: nodes[k] for k in params}, {k: one[k] for k in params}) < 5e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices,message",
    [
        (["--trainer.devices=1"], "WORLD_SIZE=2 but trainer.devices=1"),
        (["--trainer.devices=auto", "--trainer.strategy=auto"], "would train its own copy"),
    ],
    ids=["devices=1", "devices=auto"],
)
def test_torchrun_with_mismatched_devices_stops_with_a_clear_message(tmp_path, devices, message):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "bft_lightning",
        "fit",
        "--config",
        str(EXPERIMENT),
        *tiny(tmp_path, 300, BATCH),
        *devices,
    ]
    out = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert out.returncode != 0
    assert message in out.stdout + out.stderr
    assert not list(tmp_path.rglob("*.ckpt"))  # nothing trained


# ----------------------------------------------------------------------------- no processes
def test_node_rank_beyond_num_nodes_is_refused(monkeypatch, tmp_path):
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NODE_RANK", "1")
    with pytest.raises(SystemExit, match="NODE_RANK=1 but trainer.num_nodes=1"):
        main(["--config", str(EXPERIMENT), *tiny(tmp_path, 300, BATCH)], run=False)


def test_multi_node_without_master_addr_is_refused(monkeypatch, tmp_path):
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    args = [
        "--config",
        str(EXPERIMENT),
        "--trainer.num_nodes=2",
        "--trainer.strategy=ddp",
        *tiny(tmp_path, 300, BATCH),
    ]
    with pytest.raises(SystemExit, match="num_nodes=2 but MASTER_ADDR is not set"):
        main(args, run=False)


def test_compose_command_matches_the_configs():
    """The Docker nodes run the shipped CPU DDP config, one process per node, two nodes."""
    cmd = compose_command()
    assert cmd[:3] == ["fit", "--config", "configs/experiments/sasrec_on_synthetic.yaml"]
    assert (REPO / cmd[cmd.index("--trainer") + 1]).is_file()
    spec = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    ranks = sorted(s["environment"]["NODE_RANK"] for s in spec["services"].values())
    assert ranks == ["0", "1"] and "--trainer.num_nodes=2" in cmd
