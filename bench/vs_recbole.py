"""Training speed and accuracy of our SASRec (precision=off) against RecBole 1.2.1's SASRec.

Both frameworks train SASRec on the same Amazon Beauty sequences, on the same
machine, one after the other, for the same number of epochs, with the same
model size, loss, batch size, learning rate and thread count. The script:

1. creates a separate virtual environment for RecBole (default
   ``logs/venv-recbole``) if absent and installs ``torch`` (the version this
   interpreter runs) and ``recbole==1.2.1`` into it;
2. writes the user sequences our ``SequenceDataModule`` serves (after its id
   remapping) as a RecBole atomic ``.inter`` file, with a per-user increasing
   synthetic timestamp so that RecBole's time ordering is the sequence order;
3. trains RecBole's SASRec in a subprocess with that environment's python
   (leave-one-out ``LS: valid_and_test``, ``order: TO``, full ranking), then
   ours through ``bft_lightning.cli`` with the experiment config;
4. reports the median seconds per training epoch (training only: no
   validation is run and evaluation is not timed), training sequences and
   next-item targets per second, and test HR@10 / NDCG@10 of the final
   weights, as a Markdown table printed and written to ``--results``.

Usage (the command behind ``results/perf/vs_recbole.md``)::

    OMP_WAIT_POLICY=PASSIVE python bench/vs_recbole.py
    OMP_WAIT_POLICY=PASSIVE python bench/vs_recbole.py --epochs 20 --threads 2

What counts as a training sequence differs: RecBole trains on every prefix of
every user's training part (one target each), ours on one row per user that
predicts every next item of its most recent ``max_len + 1`` training items. The
targets per epoch are (nearly) the same, so targets/s is the like-for-like
throughput and the ratio is taken on it.

Known incompatibilities of RecBole 1.2.1 with current packages are handled in
the runner without touching its installed files: ``torch.load`` defaults to
``weights_only=True`` since torch 2.6, which breaks RecBole's reload of its own
checkpoints, so the runner passes ``weights_only=False``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.hardware import load_average  # noqa: E402

from bft_lightning.cli import main as cli_main  # noqa: E402
from bft_lightning.metrics.report import write_text_atomic  # noqa: E402
from bft_lightning.utils import EpochTimer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECBOLE_VERSION = "1.2.1"
DATASET = "beauty-s3rec"
# RecBole 1.2.1 predates numpy 2 and pandas 3; see ``install_recbole``.
RECBOLE_PINS = ["numpy<2", "pandas<3"]

RUNNER = textwrap.dedent(
    '''
    """Train and test RecBole's SASRec from a JSON config; write timings and metrics."""

    import json
    import sys
    import time

    import torch

    settings = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(settings["threads"])

    _torch_load = torch.load


    def _load_full(*args, **kwargs):
        """RecBole reloads its own checkpoints (numpy values inside): not weights-only."""
        kwargs.setdefault("weights_only", False)
        return _torch_load(*args, **kwargs)


    torch.load = _load_full

    import recbole
    from recbole.config import Config
    from recbole.data import create_dataset, data_preparation
    from recbole.model.sequential_recommender import SASRec
    from recbole.trainer import Trainer
    from recbole.utils import init_logger, init_seed

    config = Config(model="SASRec", dataset=settings["dataset"], config_dict=settings["config"])
    init_seed(config["seed"], config["reproducibility"])
    init_logger(config)
    t0 = time.perf_counter()
    dataset = create_dataset(config)
    train_data, valid_data, test_data = data_preparation(config, dataset)
    prepare_s = time.perf_counter() - t0
    init_seed(config["seed"], config["reproducibility"])
    model = SASRec(config, train_data._dataset).to(config["device"])
    trainer = Trainer(config, model)
    epoch_seconds = []
    train_epoch = trainer._train_epoch


    def timed_train_epoch(*args, **kwargs):
        start = time.perf_counter()
        out = train_epoch(*args, **kwargs)
        epoch_seconds.append(time.perf_counter() - start)
        return out


    trainer._train_epoch = timed_train_epoch
    valid_scores = []
    valid_epoch = trainer._valid_epoch


    def recorded_valid_epoch(*args, **kwargs):
        score, result = valid_epoch(*args, **kwargs)
        valid_scores.append(float(score))
        return score, result


    trainer._valid_epoch = recorded_valid_epoch
    validate = config["eval_step"] > 0
    trainer.fit(
        train_data, valid_data=valid_data if validate else None, saved=True, show_progress=False
    )
    t0 = time.perf_counter()
    result = trainer.evaluate(test_data, load_best_model=True, show_progress=False)
    test_s = time.perf_counter() - t0
    out = {
        "recbole": recbole.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "epoch_seconds": epoch_seconds,
        "valid_ndcg10": valid_scores,
        "train_rows": len(train_data._dataset),
        "test_users": len(test_data._dataset),
        "num_items": dataset.item_num - 1,
        "params": sum(p.numel() for p in model.parameters()),
        "prepare_s": prepare_s,
        "test_s": test_s,
        "metrics": {k: float(v) for k, v in result.items()},
    }
    open(sys.argv[2], "w").write(json.dumps(out, indent=1))
    '''
)


class InstallError(RuntimeError):
    """An install step failed; the message names the step and the command."""


# ---------------------------------------------------------------- environment


def _run(cmd: list[str], what: str, **kwargs: Any) -> str:
    """Run ``cmd``; on failure raise ``InstallError`` naming ``what`` with the output tail."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise InstallError(
            f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}\n"
            "If this machine is offline or the package registry is unreachable, create the "
            "environment elsewhere or pass --venv to one that already has RecBole."
        )
    return proc.stdout


def venv_python(venv: Path) -> Path:
    """The interpreter of a virtual environment."""
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def recbole_ready(python: Path) -> str | None:
    """``"recbole X, torch Y"`` if RecBole imports in ``python``, else ``None``."""
    if not python.exists():
        return None
    probe = (
        "import recbole, torch; print(f'recbole {recbole.__version__}, torch {torch.__version__}')"
    )
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if proc.returncode != 0 or RECBOLE_VERSION not in proc.stdout:
        return None
    return proc.stdout.strip()


def install_recbole(venv: Path, torch_spec: str, pip_args: list[str]) -> str:
    """Create ``venv`` if needed and install torch, then RecBole and its pins.

    torch goes first and pinned, so RecBole's ``torch>=1.10`` does not pull a
    different (e.g. multi-GB CUDA) build. RecBole 1.2.1 then needs packages
    from before numpy 2 and pandas 3 (``RECBOLE_PINS``).
    """
    python = venv_python(venv)
    found = recbole_ready(python)
    if found is not None:
        return found
    if not python.exists():
        print(f"creating virtual environment {venv}", flush=True)
        _run([sys.executable, "-m", "venv", str(venv)], f"creating the virtual environment {venv}")
    pip = [str(python), "-m", "pip", "install", "--quiet", *pip_args]
    print(f"installing {torch_spec} into {venv}", flush=True)
    _run([*pip, torch_spec], f"installing {torch_spec} into {venv}")
    pins = [f"recbole=={RECBOLE_VERSION}", *RECBOLE_PINS]
    print(f"installing {' '.join(pins)} into {venv}", flush=True)
    _run([*pip, *pins, torch_spec], f"installing RecBole {RECBOLE_VERSION} into {venv}")
    found = recbole_ready(python)
    if found is None:
        _run([str(python), "-c", "import recbole"], f"importing RecBole in {venv}")
        raise InstallError(f"RecBole in {venv} is not version {RECBOLE_VERSION}")
    return found


# ---------------------------------------------------------------- our side


def our_cli(args: argparse.Namespace, log_dir: Path) -> Any:
    """Our LightningCLI, built from the experiment config but not run.

    Without ``--converge`` validation is switched off (``limit_val_batches=0``):
    neither framework validates, so no checkpoint is chosen by validation and
    the test scores are those of the final weights. With ``--converge P`` both
    validate after every epoch, stop after P epochs without a better validation
    NDCG@10 (at most ``--epochs``) and test the best validation epoch's weights.
    """
    argv = [
        "--config", str(args.config), f"--seed_everything={args.seed}",
        f"--data.init_args.seed={args.seed}", f"--data.init_args.data_root={args.data_root}",
        f"--trainer.max_epochs={args.epochs}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={log_dir}", "--trainer.logger.init_args.name=ours",
        f"--data.init_args.train_rows={args.train_rows}", *args.override,
    ]  # fmt: skip
    argv += (
        ["--trainer.check_val_every_n_epoch=1"]
        if args.converge
        else ["--trainer.limit_val_batches=0"]
    )
    cli = cli_main(argv, run=False)
    if args.converge:
        stoppers = [cb for cb in cli.trainer.callbacks if isinstance(cb, EarlyStopping)]
        keepers = [cb for cb in cli.trainer.callbacks if isinstance(cb, ModelCheckpoint)]
        watched = [(cb.monitor, cb.mode) for cb in stoppers + keepers]
        if len(stoppers) != 1 or len(keepers) != 1 or set(watched) != {("val/ndcg@10", "max")}:
            raise SystemExit(
                f"error: {args.config}: --converge needs one EarlyStopping and one ModelCheckpoint "
                "on val/ndcg@10 (mode max) in the trainer's callbacks"
            )
        stoppers[0].patience = args.converge
    return cli


def settings_of(cli: Any, config: Path) -> dict[str, Any]:
    """Model size, loss and optimisation settings of our config, for RecBole."""
    model = cli.config["model"]["init_args"]
    backbone = model["backbone"]["init_args"]
    data = cli.config["data"]["init_args"]
    if model["backbone"]["class_path"].rsplit(".", 1)[-1] != "SASRec":
        raise SystemExit(f"error: {config}: the backbone is not SASRec")
    if backbone["precision"] != "off" or model["loss"] != "ce":
        raise SystemExit(f"error: {config}: compare the precision=off SASRec with loss=ce")
    if model["warmup_steps"] or model["cosine"]:
        raise SystemExit(f"error: {config}: RecBole has no warm-up or cosine schedule")
    return {
        "d_model": backbone["d_model"],
        "nhead": backbone["nhead"],
        "num_layers": backbone["num_layers"],
        "dim_feedforward": backbone["dim_feedforward"],
        "dropout": backbone["dropout"],
        "loss": model["loss"],
        "lr": model["lr"],
        "weight_decay": model["weight_decay"],
        "max_len": data["max_len"],
        "batch_size": data["batch_size"],
        "eval_batch_size": data["eval_batch_size"],
        # ours only (RecBole shuffles rows and averages the loss over a batch's rows)
        "bucket_by_length": data.get("bucket_by_length", True),
        "loss_normalization": model.get("loss_normalization", "targets"),
    }


class ValidationRecord(L.Callback):
    """Validation NDCG@10 after each validation epoch (the sanity check excluded)."""

    def __init__(self) -> None:
        self.scores: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after the module's epoch-end hook, which computes and logs the metric
        if not trainer.sanity_checking and "val/ndcg@10" in trainer.callback_metrics:
            self.scores.append(float(trainer.callback_metrics["val/ndcg@10"]))


def run_ours(cli: Any, converge: bool) -> dict[str, Any]:
    """Train ours, then test the final weights (or, with ``converge``, the best validation's)."""
    timer, record = EpochTimer(), ValidationRecord()
    cli.trainer.callbacks += [timer, record]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    start = time.perf_counter()
    best = "best" if converge else None
    cli.trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path=best, verbose=False)
    test_s = time.perf_counter() - start
    arrays = cli.datamodule.train_dataloader().dataset.arrays
    train = arrays["seq"]
    # a position predicts the next item when both are items (not padding); prefix rows
    # carry their count of targets
    targets = ((train[:, :-1] > 0) & (train[:, 1:] > 0)).sum()
    if "num_targets" in arrays:
        targets = arrays["num_targets"].sum()
    metrics = cli.model.test_results
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "epoch_seconds": timer.times,
        "valid_ndcg10": record.scores,
        "train_rows": int(len(train)),
        "train_targets": int(targets),
        "test_users": int(metrics["n"]),
        "params": sum(p.numel() for p in cli.model.parameters()),
        "test_s": test_s,
        "metrics": {"hit@10": float(metrics["hr@10"]), "ndcg@10": float(metrics["ndcg@10"])},
    }


# ---------------------------------------------------------------- RecBole side


def write_atomic(cli: Any, folder: Path) -> dict[str, int]:
    """Our remapped sequences as ``<folder>/<DATASET>/<DATASET>.inter``.

    One row per interaction: the user's 0-based index in our data, our item id
    and the position in the user's sequence as the timestamp, so that RecBole's
    per-user time order is our sequence order.
    """
    data = cli.datamodule.sequences
    path = folder / DATASET / f"{DATASET}.inter"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["user_id:token\titem_id:token\ttimestamp:float"]
    for user in range(data.num_users):
        items = data.items[data.offsets[user] : data.offsets[user + 1]]
        lines += [f"{user}\t{item}\t{pos}" for pos, item in enumerate(items.tolist())]
    path.write_text("\n".join(lines) + "\n")
    short = int((data.lengths < 3).sum())
    return {"users": data.num_users, "items": data.num_items, "short_users": short}


def recbole_config(ours: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """RecBole settings matching our config (see ``settings_of``)."""
    return {
        "data_path": str(work),
        "checkpoint_dir": str(work / "saved"),
        "use_gpu": False,
        "seed": args.seed,
        "reproducibility": True,
        "state": "INFO",
        "show_progress": False,
        "log_wandb": False,
        "worker": 0,
        "USER_ID_FIELD": "user_id",
        "ITEM_ID_FIELD": "item_id",
        "TIME_FIELD": "timestamp",
        "load_col": {"inter": ["user_id", "item_id", "timestamp"]},
        "user_inter_num_interval": "[0,inf)",
        "item_inter_num_interval": "[0,inf)",
        "MAX_ITEM_LIST_LENGTH": ours["max_len"],
        "eval_args": {
            "split": {"LS": "valid_and_test"},
            "order": "TO",
            "group_by": "user",
            "mode": "full",
        },
        "metrics": ["Hit", "NDCG"],
        "topk": [10],
        "valid_metric": "NDCG@10",
        "epochs": args.epochs,
        # without --converge no validation: train only, keep the final weights; with it,
        # validate every epoch and stop after ``converge`` epochs without a better score
        # (RecBole stops when its count of such epochs exceeds stopping_step)
        "eval_step": 1 if args.converge else 0,
        "stopping_step": max(args.converge - 1, 0),
        "train_batch_size": ours["batch_size"],
        "eval_batch_size": ours["eval_batch_size"],
        "learner": "adam",  # = our AdamW at weight_decay 0
        "learning_rate": ours["lr"],
        "weight_decay": ours["weight_decay"],
        "train_neg_sample_args": None,
        "loss_type": ours["loss"].upper(),
        "n_layers": ours["num_layers"],
        "n_heads": ours["nhead"],
        "hidden_size": ours["d_model"],
        "inner_size": ours["dim_feedforward"],
        "hidden_dropout_prob": ours["dropout"],
        "attn_dropout_prob": ours["dropout"],
        "hidden_act": "gelu",
    }


def run_recbole(python: Path, config: dict[str, Any], threads: int, work: Path) -> dict[str, Any]:
    """Train and test RecBole's SASRec in a subprocess with the RecBole environment."""
    runner, settings, result = work / "run_recbole.py", work / "settings.json", work / "out.json"
    runner.write_text(RUNNER)
    settings.write_text(json.dumps({"dataset": DATASET, "threads": threads, "config": config}))
    result.unlink(missing_ok=True)
    log = work / "recbole_stdout.log"
    with open(log, "w") as fh:
        proc = subprocess.run(
            [str(python), str(runner), str(settings), str(result)],
            cwd=work, env=_thread_env(threads), stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
    if proc.returncode != 0 or not result.exists():
        tail = "\n".join(log.read_text().strip().splitlines()[-25:])
        raise SystemExit(f"error: the RecBole run failed (exit {proc.returncode}); {log}:\n{tail}")
    return json.loads(result.read_text())


def _thread_env(threads: int) -> dict[str, str]:
    """This environment with every thread-pool size set to ``threads``."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = str(threads)
    return env


# ---------------------------------------------------------------- report


def row(name: str, run: dict[str, Any], targets: int) -> dict[str, Any]:
    """One table row: median s/epoch, rows/s, targets/s and test metrics."""
    sec = statistics.median(run["epoch_seconds"])
    return {
        "framework": name,
        "sec_per_epoch": sec,
        "rows_per_epoch": run["train_rows"],
        "rows_per_s": run["train_rows"] / sec,
        "targets_per_s": targets / sec,
        "hr10": run["metrics"]["hit@10"],
        "ndcg10": run["metrics"]["ndcg@10"],
        "epochs": len(run["epoch_seconds"]),
        "best_epoch": _best_epoch(run.get("valid_ndcg10", [])),
        "epoch_seconds": run["epoch_seconds"],
        "test_users": run["test_users"],
        "params": run["params"],
    }


def _best_epoch(scores: list[float]) -> int | None:
    """1-based epoch of the first best validation score (None without validation)."""
    return scores.index(max(scores)) + 1 if scores else None


def machine_note(threads: int, load_before: float, load_after: float) -> str:
    """Cores, threads per run and the load average around the runs."""
    cores = os.cpu_count() or 0
    shared = " (other jobs shared the cores)" if load_before > 0.5 else ""
    return (
        f"{platform.machine()} CPU, {cores} cores, {threads} thread(s) per run; 1-min load "
        f"average {load_before:.1f} before the runs and {load_after:.1f} after them{shared}"
    )


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def markdown(
    args: argparse.Namespace, rows: list[dict[str, Any]], info: dict[str, Any], elapsed: float
) -> str:
    """The results file."""
    ours, rb = rows
    ratio = ours["targets_per_s"] / rb["targets_per_s"]
    s = info["settings"]
    env = "OMP_WAIT_POLICY=PASSIVE " if os.environ.get("OMP_WAIT_POLICY") == "PASSIVE" else ""
    cmd = f"{env}python bench/vs_recbole.py {shlex.join(args.argv)}".rstrip()
    lines = [
        "# SASRec: bft_lightning (precision=off) vs RecBole",
        "",
        f"Command: `{cmd}` ({elapsed / 60:.0f} min in all)",
        "",
        f"Machine: {info['machine']}. {info['versions']}.",
        "",
        f"Data: Amazon Beauty (S3-Rec), the sequences our DataModule serves: "
        f"{info['data']['users']:,} users, {info['data']['items']:,} items; leave-one-out "
        "(RecBole `LS: valid_and_test`, `order: TO` on a synthetic per-user timestamp), full "
        "ranking over all items, no history masking, test on every user.",
        "",
        f"Model and training (both): d_model {s['d_model']}, {s['nhead']} heads, "
        f"{s['num_layers']} layers, FFN {s['dim_feedforward']}, dropout {s['dropout']}, "
        f"max length {s['max_len']}, loss {s['loss'].upper()} over all items, Adam(W) lr "
        f"{s['lr']}, weight decay {s['weight_decay']}, batch {s['batch_size']}, "
        + (
            f"validation NDCG@10 after every epoch, early stopping after {args.converge} epochs "
            f"without a better one (at most {args.epochs}), seed {args.seed}; test scores are "
            "those of the best validation epoch's weights."
            if args.converge
            else f"{_plural(args.epochs, 'epoch')}, seed {args.seed}. No validation; test "
            "scores are those of the final weights."
        ),
        "",
        "| framework | s/epoch | sequences/s | targets/s | HR@10 | NDCG@10 | epochs (best) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        best = f" ({r['best_epoch']})" if r["best_epoch"] else ""
        lines.append(
            f"| {r['framework']} | {r['sec_per_epoch']:.1f} | {r['rows_per_s']:,.0f} | "
            f"{r['targets_per_s']:,.0f} | {r['hr10']:.4f} | {r['ndcg10']:.4f} | "
            f"{r['epochs']}{best} |"
        )
    lines += [
        "",
        f"Throughput ratio ours / RecBole (targets/s): **{ratio:.2f}x**.",
        "",
        "s/epoch: median wall-clock seconds of the training part of an epoch (data loading "
        "included, evaluation excluded); per epoch: "
        + "; ".join(
            f"{r['framework']} " + ", ".join(f"{t:.1f}" for t in r["epoch_seconds"]) for r in rows
        )
        + ". A sequence is one training row: RecBole trains on every prefix of each user's "
        f"training part ({rb['rows_per_epoch']:,} rows, one target each), ours "
        + (
            f"on the same prefix rows (`train_rows: prefix`, {ours['rows_per_epoch']:,} rows, "
            f"{info['our_targets']:,} targets)."
            if args.train_rows == "prefix"
            else f"on one row per user predicting every next item ({ours['rows_per_epoch']:,} "
            f"rows, {info['our_targets']:,} targets), so sequences/s are not comparable and "
            "targets/s is the like-for-like throughput."
        ),
        "",
        "Differences that remain: RecBole's SASRec is post-norm with a LayerNorm on the input "
        "embeddings, pads every row to the full length and uses Adam; ours is pre-norm, scales "
        "item embeddings by sqrt(d), trims each batch to its longest row "
        + (
            "(batches bucketed by length, "
            + (
                "the loss divided by the batch's rows)"
                if s.get("loss_normalization") == "rows"
                else "the loss a mean over the batch's targets)"
            )
            if s.get("bucket_by_length", True)
            else "(rows shuffled, not bucketed)"
        )
        + " and uses AdamW with weight decay 0 (the same update). Parameters: "
        f"ours {ours['params']:,}, RecBole {rb['params']:,}.",
    ]
    if args.converge:
        to_best = [sum(r["epoch_seconds"][: r["best_epoch"] or 0]) / 60 for r in rows]
        lines += [
            "",
            f"At convergence (one seed): test HR@10 ours / RecBole {ours['hr10']:.4f} / "
            f"{rb['hr10']:.4f} ({ours['hr10'] / rb['hr10'] - 1:+.1%}), NDCG@10 "
            f"{ours['ndcg10']:.4f} / {rb['ndcg10']:.4f} "
            f"({ours['ndcg10'] / rb['ndcg10'] - 1:+.1%}). Training time to the best "
            f"validation epoch (the training epochs' seconds up to it): ours {to_best[0]:.1f} "
            f"min, RecBole {to_best[1]:.1f} min.",
        ]
    if args.epochs < 20 and not args.converge and args.train_rows == "user":
        lines += [
            "",
            f"Accuracy after {_plural(args.epochs, 'epoch')} is not comparable: both models are "
            "far from convergence (our SASRec on this data reaches its best validation NDCG@10 "
            "after about 20 epochs, see results/rec/beauty_sasrec.md), and RecBole takes about "
            f"{rb['rows_per_epoch'] / ours['rows_per_epoch']:.0f}x more optimiser steps per "
            "epoch (one per 256 prefixes instead of one per 256 users), so it is further "
            "along after the same number of epochs. The HR@10 / NDCG@10 columns only show "
            "that both pipelines train and evaluate; compare accuracy with `--epochs` large "
            "enough for both to converge.",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--epochs", type=int, default=3, help="training epochs of each framework")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads of each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--converge",
        type=int,
        default=0,
        metavar="P",
        help="validate after every epoch, stop after P epochs without a better validation "
        "NDCG@10 (at most --epochs) and test the best epoch's weights (default 0: no validation, "
        "fixed epochs, final weights)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=ROOT / "configs" / "experiments" / "sasrec_off_beauty.yaml",
        help="our experiment config (SASRec, precision=off, loss=ce)",
    )
    p.add_argument(
        "--train-rows",
        choices=["user", "prefix"],
        default="user",
        help="our training rows: one per user (every position a target) or one per target "
        "(every prefix, RecBole's view); see SequenceDataModule",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="an extra argument of our CLI, as --override=--data.init_args.x=1 (repeatable); "
        "RecBole's settings follow the resulting config",
    )
    p.add_argument("--data-root", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--venv", type=Path, default=ROOT / "logs" / "venv-recbole")
    p.add_argument(
        "--torch-spec",
        default=None,
        help="torch requirement for the RecBole environment (default: the version running here)",
    )
    p.add_argument(
        "--pip-args", default="", help="extra pip arguments, e.g. '--index-url URL' (one string)"
    )
    p.add_argument("--work-dir", type=Path, default=None, help="default: a fresh temp dir in logs/")
    p.add_argument("--results", type=Path, default=ROOT / "results" / "perf" / "vs_recbole.md")
    p.add_argument(
        "--report-from",
        type=Path,
        default=None,
        metavar="WORK_DIR",
        help="only rewrite --results from a finished run's WORK_DIR/summary.json (described "
        "with that run's own options)",
    )
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.epochs < 1 or args.threads < 1:
        p.error("--epochs and --threads must be >= 1")
    if args.converge < 0:
        p.error("--converge must be >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report_from is not None:  # rewrite the results file from a finished run
        summary = args.report_from / "summary.json"
        if not summary.exists():
            raise SystemExit(f"error: {summary}: no finished run there")
        done = json.loads(summary.read_text())
        if "argv" in done["info"]:  # the run's own options (epochs, converge, seed) describe it
            run_args = parse_args(done["info"]["argv"])
            run_args.results = args.results
            args = run_args
        write_results(args, done["rows"], done["info"])
        return
    started, load_before = time.perf_counter(), load_average()
    os.environ.update(_thread_env(args.threads))
    torch.set_num_threads(args.threads)
    torch_spec = args.torch_spec or f"torch=={torch.__version__}"
    try:
        versions = install_recbole(args.venv, torch_spec, shlex.split(args.pip_args))
    except InstallError as err:
        raise SystemExit(f"error: {err}") from None
    (ROOT / "logs").mkdir(exist_ok=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="vs_recbole_", dir=ROOT / "logs"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"RecBole environment: {versions}; work dir {work}", flush=True)

    cli = our_cli(args, work)
    plan = f" at most, early stopping after {args.converge}" if args.converge else ""
    settings = settings_of(cli, args.config)
    data = write_atomic(cli, work)
    if data["short_users"]:
        print(f"warning: {data['short_users']} users with < 3 items: the splits differ for them")
    print(f"[1/2] RecBole SASRec, {args.epochs} epochs{plan}", flush=True)
    rb = run_recbole(
        venv_python(args.venv), recbole_config(settings, args, work), args.threads, work
    )
    print(f"[2/2] ours, {args.epochs} epochs{plan}", flush=True)
    ours = run_ours(cli, bool(args.converge))
    rows = [row("bft_lightning", ours, ours["train_targets"]), row("RecBole", rb, rb["train_rows"])]
    info = {
        "settings": settings,
        "data": data,
        "machine": machine_note(args.threads, load_before, load_average()),
        "our_targets": ours["train_targets"],
        "argv": args.argv,
        "versions": (
            f"Python {platform.python_version()}, torch {ours['torch']} (ours) / "
            f"{versions} (RecBole's environment)"
        ),
    }
    info["elapsed_s"] = time.perf_counter() - started
    # atomic: --report-from reads the summary back
    write_text_atomic(work / "summary.json", json.dumps({"rows": rows, "info": info}, indent=1))
    write_results(args, rows, info)


def write_results(
    args: argparse.Namespace, rows: list[dict[str, Any]], info: dict[str, Any]
) -> None:
    text = markdown(args, rows, info, info["elapsed_s"])
    args.results.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.results, text)
    print(text)
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
