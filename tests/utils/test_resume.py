"""Resume and faults: exact mid-epoch resume, atomic checkpoints, safe loading.

What is guaranteed (single process, ``deterministic=True``, the
``SequenceDataModule`` training loader, ``StepSeed`` for dropout and sampled
negatives): a run stopped at any training step, even twice in one epoch, and
resumed from its last checkpoint ends with bit-identical weights, optimizer
state and metrics to a run that was never stopped. The checkpoint records how
many batches of the epoch were used (``ResumableDataLoader``), Lightning pins
the epoch's order (``set_epoch``), and ``StepSeed`` makes each step's random
numbers a function of ``(seed, epoch, batch, rank)``.

Default tier: the same in one process (a crash raised from a callback), the
loader's bookkeeping, atomic writes and safe loading. Slow tier: the process is
killed with SIGKILL (``python -m bft_lightning fit``, as in production) and
resumed twice in the same epoch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from bft_lightning.cli import main
from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.datamodules.recommendation import LengthBucketSampler
from bft_lightning.models import SASRec
from bft_lightning.tasks import SequentialRecommendation
from bft_lightning.utils import (
    AtomicCheckpointIO,
    CheckpointLoadError,
    ResumableDataLoader,
    StepSeed,
    atomic_torch_save,
    safe_load_checkpoint,
)
from bft_lightning.utils import checkpoint_io as checkpoint_io_mod

pytestmark = pytest.mark.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = REPO / "configs" / "experiments" / "sasrec_on_synthetic.yaml"


# ----------------------------------------------------------------------------- the loader
def loader(n: int = 50, batch: int = 4) -> ResumableDataLoader:
    sampler = LengthBucketSampler(np.arange(n) % 7, batch, seed=3)
    return ResumableDataLoader(list(range(n)), batch_size=batch, sampler=sampler)


def epoch_batches(dl: ResumableDataLoader, epoch: int) -> list[list[int]]:
    dl.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    return [b.tolist() for b in dl]


def test_resumable_loader_continues_where_the_state_says():
    full = epoch_batches(loader(), 2)
    first = loader()
    first.sampler.set_epoch(2)  # type: ignore[attr-defined]
    it = iter(first)
    seen = [next(it).tolist() for _ in range(3)]
    assert seen == full[:3] and first.state_dict() == {"batches": 3, "epoch": 2}

    second = loader()  # a new process: same sampler seed, state from the checkpoint
    second.load_state_dict(first.state_dict())
    second.sampler.set_epoch(2)  # type: ignore[attr-defined]  (after load, as Lightning does)
    it = iter(second)
    seen += [next(it).tolist() for _ in range(2)]
    assert second.state_dict() == {"batches": 5, "epoch": 2}  # from the epoch start

    third = loader()  # a second interruption in the same epoch
    third.load_state_dict(second.state_dict())
    assert seen + epoch_batches(third, 2) == full
    assert epoch_batches(third, 3) == epoch_batches(loader(), 3)  # the skip applies once


def test_state_of_a_finished_epoch_skips_nothing():
    dl = loader()
    dl.load_state_dict({"batches": len(dl)})  # saved on the epoch's last batch
    assert epoch_batches(dl, 1) == epoch_batches(loader(), 1)


def test_an_epoch_cut_short_by_a_limit_is_finished_too():
    """limit_train_batches=3 of 13: a checkpoint after the epoch's third batch is at
    the epoch's end; the next epoch (a new sampler epoch) starts at its first batch."""
    first = loader()
    first.sampler.set_epoch(0)  # type: ignore[attr-defined]
    it = iter(first)
    for _ in range(3):  # Lightning stops taking batches at the limit
        next(it)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())  # {"batches": 3, "epoch": 0}
    assert epoch_batches(resumed, 1) == epoch_batches(loader(), 1)
    mid = loader()  # the same state in its own epoch still skips the three
    mid.load_state_dict(first.state_dict())
    assert epoch_batches(mid, 0) == epoch_batches(loader(), 0)[3:]


# ----------------------------------------------------------------------------- in-process resume
class Crash(Exception):
    """The stand-in for a failure in the middle of training."""


class CrashAtStep(Callback):
    """Fail after optimizer step ``step`` (before that step's checkpoint is written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            raise Crash(f"crash at step {self.step}")


def run_fit(tmp_path: Path, crash_at: int | None = None, resume: str | None = None):
    L.seed_everything(0, workers=True)
    dm = SequenceDataModule(max_len=10, batch_size=32, synthetic_users=300, synthetic_items=80)
    backbone = partial(
        SASRec, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, dropout=0.3, precision="on"
    )
    model = SequentialRecommendation(
        dm.num_items, 10, backbone=backbone, loss="bce", num_negatives=10, lr=3e-3
    )
    callbacks: list[Callback] = [
        StepSeed(),
        ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_last=True),
    ]
    if crash_at is not None:
        callbacks.insert(0, CrashAtStep(crash_at))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=tmp_path,
    )
    if crash_at is None:
        trainer.fit(model, dm, ckpt_path=resume)
    else:
        with pytest.raises(Crash):
            trainer.fit(model, dm, ckpt_path=resume)
    return trainer, model


def test_stopped_mid_epoch_and_resumed_equals_uninterrupted(tmp_path):
    done, model = run_fit(tmp_path / "full")
    steps_per_epoch = done.num_training_batches
    assert steps_per_epoch >= 6
    crash = steps_per_epoch + 4  # epoch 1, 5th batch; last checkpoint at a multiple of 3
    stopped, _ = run_fit(tmp_path / "cut", crash_at=crash)
    assert stopped.global_step == crash
    last = tmp_path / "cut" / "ckpt" / "last.ckpt"
    saved = safe_load_checkpoint(last)
    assert saved["global_step"] < crash and saved["global_step"] % steps_per_epoch != 0
    resumed, model_r = run_fit(tmp_path / "cut", resume=str(last))
    assert resumed.global_step == done.global_step == 2 * steps_per_epoch
    a, b = model.state_dict(), model_r.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt_a = done.optimizers[0].state_dict()["state"]
    opt_b = resumed.optimizers[0].state_dict()["state"]
    assert all(torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"]) for i in opt_a)


# ----------------------------------------------------------------------------- atomic writes
def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": torch.tensor(1)}, path)
    before = path.read_bytes()
    real_save = torch.save

    def half_then_die(obj, fh):  # type: ignore[no-untyped-def]
        real_save(obj, fh)
        fh.truncate(fh.tell() // 2)
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(checkpoint_io_mod.torch, "save", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        AtomicCheckpointIO().save_checkpoint({"step": torch.tensor(2)}, path)
    monkeypatch.setattr(checkpoint_io_mod.torch, "save", real_save)
    assert path.read_bytes() == before  # the previous checkpoint, complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temp file left
    assert int(safe_load_checkpoint(path)["step"]) == 1


def test_a_half_written_checkpoint_is_never_read_as_valid(tmp_path):
    path = tmp_path / "model.ckpt"
    atomic_torch_save({"state_dict": {"w": torch.randn(64, 64)}}, path)
    data = path.read_bytes()
    for cut in (0, 100, len(data) // 2, len(data) - 10):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointLoadError, match=str(path)):
            AtomicCheckpointIO().load_checkpoint(path)


class Payload:
    """Anything that is not a tensor or a plain container."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo pwned",))


def test_checkpoints_are_loaded_without_unpickling_code(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": Payload()}, path)
    with pytest.raises(CheckpointLoadError, match=r"evil.ckpt: refused to load"):
        safe_load_checkpoint(path)


def test_atomic_checkpoint_io_is_in_every_shipped_trainer_config():
    import yaml

    for config in sorted((REPO / "configs" / "trainer").glob("*.yaml")):
        plugins = yaml.safe_load(config.read_text()).get("plugins") or []
        names = [p["class_path"] if isinstance(p, dict) else p for p in plugins]
        assert "bft_lightning.utils.AtomicCheckpointIO" in names, config.name


# ----------------------------------------------------------------------------- killed process
CHILD = """
import os, signal, sys
from lightning.pytorch import Callback

class KillAtStep(Callback):
    def __init__(self, step: int = -1):
        self.step = step
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

from bft_lightning.cli import main
main()
"""


def cli_args(tmp: Path, command: str = "fit") -> list[str]:
    trainer_yaml = tmp / "trainer.yaml"
    trainer_yaml.write_text(
        f"""accelerator: cpu
devices: 1
max_epochs: 3
deterministic: true
logger: false
enable_progress_bar: false
enable_model_summary: false
check_val_every_n_epoch: 1
default_root_dir: {tmp}
plugins:
  - class_path: bft_lightning.utils.AtomicCheckpointIO
callbacks:
  - class_path: bft_lightning.utils.StepSeed
  - class_path: lightning.pytorch.callbacks.ModelCheckpoint
    init_args:
      dirpath: {tmp / "ckpt"}
      every_n_train_steps: 3
      save_last: true
"""
    )
    return [
        command,
        "--config",
        str(EXPERIMENT),
        "--trainer",
        str(trainer_yaml),
        "--data.init_args.synthetic_users=300",
        "--data.init_args.max_len=12",
        "--data.init_args.batch_size=32",
        "--model.init_args.backbone.init_args.d_model=16",
        "--model.init_args.backbone.init_args.dim_feedforward=32",
        "--model.init_args.loss=bce",
        "--model.init_args.num_negatives=20",
    ]


def child(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m bft_lightning fit ...`` with ``KillAtStep`` importable from ``__main__``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-c", CHILD, *cli_args(tmp), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def final(tmp: Path) -> dict:
    return safe_load_checkpoint(tmp / "ckpt" / "last.ckpt")


@pytest.mark.slow
def test_killed_twice_mid_epoch_and_resumed_equals_uninterrupted(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    full.mkdir(), cut.mkdir()
    out = child(full)
    assert out.returncode == 0, out.stderr[-3000:]
    reference = final(full)
    per_epoch = reference["global_step"] // 3
    assert per_epoch >= 7

    kill = ["--trainer.callbacks+=__main__.KillAtStep", "--trainer.callbacks.step"]
    first, second = per_epoch + 5, per_epoch + 7  # both in epoch 1
    out = child(cut, *kill[:1], f"{kill[1]}={first}")
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    saved = final(cut)["global_step"]
    assert saved == first - first % 3 and saved % per_epoch != 0  # mid-epoch checkpoint

    out = child(cut, *kill[:1], f"{kill[1]}={second}", f"--ckpt_path={cut / 'ckpt' / 'last.ckpt'}")
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert saved < final(cut)["global_step"] < second

    out = child(cut, "--ckpt_path=last")
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = final(cut)
    assert resumed["global_step"] == reference["global_step"]
    a, b = reference["state_dict"], resumed["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for sa, sb in zip(reference["optimizer_states"], resumed["optimizer_states"]):
        for i in sa["state"]:
            assert torch.equal(sa["state"][i]["exp_avg"], sb["state"][i]["exp_avg"])

    # and the same metrics: evaluate both final checkpoints
    results = []
    for run in (full, cut):
        ckpt = run / "ckpt" / "last.ckpt"
        cli = main([*cli_args(run, "test"), f"--ckpt_path={ckpt}"])
        results.append(cli.model.test_results)
    assert results[0] == results[1] and results[0]["n"] == 300


# ----------------------------------------------------------------------------- the shipped configs
ENTRY_CHILD = """
import os, signal
from lightning.pytorch import Callback

class KillAtStep(Callback):
    def __init__(self, step: int = -1):
        self.step = step
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

from bft_lightning.cli import entry
entry()
"""


def shipped_args(logs: Path) -> list[str]:
    """The quick-start experiment with its shipped trainer config (cpu_quick.yaml), small."""
    return [
        "--config", str(EXPERIMENT),
        f"--trainer.logger.init_args.save_dir={logs}",
        "--trainer.max_epochs=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--data.init_args.synthetic_users=300",
        "--data.init_args.max_len=12",
        "--data.init_args.batch_size=4",
        "--model.init_args.backbone.init_args.d_model=16",
        "--model.init_args.backbone.init_args.dim_feedforward=32",
    ]  # fmt: skip


def entry_child(logs: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", ENTRY_CHILD, "fit", *shipped_args(logs), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_fit_ckpt_path_last_resumes_a_killed_run_in_its_own_folder(tmp_path, capsys):
    """``python -m bft_lightning fit --ckpt_path last`` with the shipped cpu_quick config:
    killed (SIGKILL) mid-epoch, resumed in the same log folder from the step-interval
    ``last.ckpt``, it ends with the weights and test metrics of an uninterrupted run.
    (The uninterrupted run and the resume run in this process, through the same entry.)"""
    from bft_lightning.cli import entry

    full, cut = tmp_path / "full", tmp_path / "cut"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the killed child: the same kernels, the same bits
    try:
        _killed_and_resumed(full, cut, entry, capsys)
    finally:
        torch.set_num_threads(threads)


def _killed_and_resumed(full: Path, cut: Path, entry, capsys) -> None:  # type: ignore[no-untyped-def]
    entry(["fit", *shipped_args(full)])
    run = full / "quick" / "version_0"
    reference = safe_load_checkpoint(run / "checkpoints" / "last.ckpt")
    per_epoch = reference["global_step"] // 2
    assert per_epoch > 55  # the step interval (50) falls inside the second epoch

    kill_at = per_epoch + 55  # epoch 1; last.ckpt was written at step 100
    kill = ["--trainer.callbacks+=__main__.KillAtStep", f"--trainer.callbacks.step={kill_at}"]
    out = entry_child(cut, *kill)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    ckpts = cut / "quick" / "version_0" / "checkpoints"
    saved = safe_load_checkpoint(ckpts / "last.ckpt")["global_step"]
    assert saved == 100 and saved % per_epoch != 0  # a mid-epoch checkpoint
    (ckpts / ".tmp-last.ckpt-stale").write_bytes(b"half a checkpoint")  # a killed writer's

    capsys.readouterr()
    entry(["fit", *shipped_args(cut), "--ckpt_path", "last"])
    assert f"resuming {ckpts / 'last.ckpt'}" in capsys.readouterr().out
    assert sorted(p.name for p in (cut / "quick").iterdir()) == ["version_0"]  # same folder
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.ckpt", "last.ckpt"]  # swept
    resumed = safe_load_checkpoint(ckpts / "last.ckpt")
    assert resumed["global_step"] == reference["global_step"]
    a, b = reference["state_dict"], resumed["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    results = []
    for logs in (full, cut):  # `test --ckpt_path best` of each run, into that run's folder
        cli = main(["test", *shipped_args(logs), "--ckpt_path", "best"])
        assert Path(cli.trainer.log_dir) == logs / "quick" / "version_0"
        assert (logs / "quick" / "version_0" / "metrics.json").is_file()
        results.append(cli.model.test_results)
    assert results[0] == results[1] and results[0]["n"] == 300


# ----------------------------------------------------------------------------- digest
def test_a_flipped_bit_is_caught_by_the_digest_and_a_resaved_edit_is_not_flagged(tmp_path):
    path = tmp_path / "model.ckpt"
    weight = torch.randn(256, 16)
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": weight}, "epoch": 2}, path)
    assert checkpoint_io_mod.stored_digest(path) is not None
    assert torch.equal(safe_load_checkpoint(path)["state_dict"]["w"], weight)
    data = bytearray(path.read_bytes())
    at = data.find(weight.numpy().tobytes())
    assert at > 0
    data[at + 1001] ^= 0x01
    flipped = tmp_path / "flipped.ckpt"
    flipped.write_bytes(bytes(data))
    assert not torch.equal(torch.load(flipped, weights_only=True)["state_dict"]["w"], weight)
    with pytest.raises(CheckpointLoadError, match=r"flipped.ckpt: content digest mismatch"):
        safe_load_checkpoint(flipped)
    edited = torch.load(path, weights_only=True)  # a deliberate edit, saved by plain torch.save
    edited["epoch"] = 3
    torch.save(edited, tmp_path / "edited.ckpt")
    assert safe_load_checkpoint(tmp_path / "edited.ckpt")["epoch"] == 3


def test_sweep_removes_only_temporary_checkpoint_files(tmp_path):
    from bft_lightning.utils import sweep_temporary_files

    for name in (".tmp-last.ckpt-abc123", "last.ckpt", ".tmp-notes.txt", "best.ckpt"):
        (tmp_path / name).write_bytes(b"x")
    assert [Path(p).name for p in sweep_temporary_files(tmp_path)] == [".tmp-last.ckpt-abc123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-notes.txt",
        "best.ckpt",
        "last.ckpt",
    ]


# ----------------------------------------------------------------------------- run folder
def run_config(save_dir: Path, ckpt: str | None, version: object = None):  # type: ignore[no-untyped-def]
    from jsonargparse import Namespace

    logger = Namespace(
        class_path="lightning.pytorch.loggers.TensorBoardLogger",
        init_args=Namespace(save_dir=str(save_dir), name="quick", version=version),
    )
    return Namespace(ckpt_path=ckpt, trainer=Namespace(logger=logger, callbacks=[]))


def test_ckpt_path_last_pins_the_newest_run_and_its_folder(tmp_path, capsys):
    from bft_lightning.utils.run_dir import pin_run

    for i, run in enumerate(("version_0", "version_1", "version_2")):
        folder = tmp_path / "quick" / run / "checkpoints"
        folder.mkdir(parents=True)
        if run != "version_2":  # version_2: a run killed before its first checkpoint
            (folder / "last.ckpt").write_bytes(b"x")
            os.utime(folder / "last.ckpt", (1000 + i, 1000 + i))
    config = run_config(tmp_path, "last")
    pin_run(config, "fit")
    newest = tmp_path / "quick" / "version_1" / "checkpoints" / "last.ckpt"
    assert config.ckpt_path == str(newest)
    assert config.trainer.logger.init_args.version == "version_1"
    assert "resuming" in capsys.readouterr().out

    config = run_config(tmp_path, "last", version=0)  # a version the config sets: that run
    pin_run(config, "fit")
    assert config.ckpt_path.endswith("version_0/checkpoints/last.ckpt")
    assert config.trainer.logger.init_args.version == 0

    explicit = str(tmp_path / "quick" / "version_0" / "checkpoints" / "last.ckpt")
    config = run_config(tmp_path, explicit)
    pin_run(config, "test")
    assert config.ckpt_path == explicit and config.trainer.logger.init_args.version == "version_0"

    config = run_config(tmp_path / "elsewhere", "last")
    pin_run(config, "fit")  # nothing to resume: a new run, said plainly
    assert config.ckpt_path is None and "starting a new run" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--ckpt_path best: no checkpoint found"):
        pin_run(run_config(tmp_path, "best"), "test")
