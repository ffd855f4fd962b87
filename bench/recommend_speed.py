"""``python -m bft_lightning recommend`` throughput in users per second, through the CLI.

Builds (once) a checkpoint of an untrained backbone on a real dataset (one
optimiser step, so that it carries the data's vocabulary, as any checkpoint
the task writes), writes ``--users`` of the dataset's histories as JSON lines
(each user's full history, oldest first), then times the ``recommend``
command as a subprocess on them and on one history (the start-up: Python,
torch, the checkpoint), and prints both and the users per second of the rest.

    OMP_WAIT_POLICY=PASSIVE python bench/recommend_speed.py --backbone sasrec --precision off
    OMP_WAIT_POLICY=PASSIVE python bench/recommend_speed.py --backbone hstu --precision on

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="amazon-beauty-s3rec")
    p.add_argument("--data_root", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--backbone", choices=("sasrec", "hstu", "bert4rec"), default="sasrec")
    p.add_argument("--precision", choices=("off", "on"), default="off")
    p.add_argument("--users", type=int, default=10_000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--exclude-seen", action="store_true")
    p.add_argument("--workdir", default="/tmp/bft_recommend_speed")
    p.add_argument("--prepare", action="store_true", help="build the files only, time nothing")
    return p.parse_args(argv)


def make_checkpoint(args: argparse.Namespace, path: Path) -> object:
    """An untrained backbone's checkpoint (d = 64, 2 layers, max_len 50) with the vocabulary."""
    import lightning as L

    from bft_lightning.datamodules import SequenceDataModule
    from bft_lightning.models import HSTU, BERT4Rec, SASRec
    from bft_lightning.tasks import SequentialRecommendation

    dm = SequenceDataModule(dataset=args.dataset, data_root=args.data_root, max_len=50)
    dm.prepare_data()
    dm.setup("fit")
    cls = {"sasrec": SASRec, "hstu": HSTU, "bert4rec": BERT4Rec}[args.backbone]
    backbone = partial(cls, d_model=64, nhead=2, num_layers=2, dim_feedforward=256,
                       precision=args.precision)  # fmt: skip
    task = SequentialRecommendation(dm.num_items, 50, backbone=backbone)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(task, datamodule=dm)
    path.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path)
    return dm


def write_histories(dm: object, path: Path, users: int) -> int:
    seq = dm.sequences  # type: ignore[attr-defined]
    n = min(users, seq.num_users)
    with open(path, "w") as fh:
        for u in range(n):
            start, end = int(seq.offsets[u]), int(seq.offsets[u + 1])
            items = [str(seq.item_ids[i]) for i in seq.items[start:end]]
            fh.write(json.dumps({"user": str(seq.user_ids[u]), "items": items}) + "\n")
    return n


def run_cli(args: argparse.Namespace, ckpt: Path, src: Path, out: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "bft_lightning", "recommend", "--ckpt_path", str(ckpt),
           "--input", str(src), "--output", str(out), "--k", str(args.k), "--no-progress",
           "--batch-size", str(args.batch_size)] + (["--exclude-seen"] if args.exclude_seen
                                                   else [])  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(args.workdir)
    name = f"{args.dataset}_{args.backbone}_{args.precision}"
    ckpt = work / f"{name}.ckpt"
    src, one = work / f"{name}_{args.users}.jsonl", work / f"{name}_1.jsonl"
    if not ckpt.exists() or not src.exists():
        dm = make_checkpoint(args, ckpt)
        n = write_histories(dm, src, args.users)
        one.write_text(src.read_text().splitlines()[0] + "\n")
    if args.prepare:
        return
    n = sum(1 for _ in open(src))
    run_cli(args, ckpt, one, work / "warm.csv")  # page cache warm
    startup = run_cli(args, ckpt, one, work / "one.csv")
    total = run_cli(args, ckpt, src, work / "out.csv")
    rate = n / max(total - startup, 1e-9)
    print("| checkpoint | users | k | exclude_seen | total (s) | start-up (s) | users/s |")
    print(f"| {name} | {n} | {args.k} | {args.exclude_seen} | {total:.2f} | {startup:.2f} "
          f"| {rate:,.0f} ({n / total:,.0f} with start-up) |")  # fmt: skip


if __name__ == "__main__":
    main()
