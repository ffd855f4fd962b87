"""Training at a real catalogue's scale: a million items, ten million interactions.

Three measurements, each in its own process (so that a process's peak RSS,
``VmHWM`` of ``/proc/self/status``, is that run's alone):

- ``generate``: the synthetic generator's time over users and items.
- ``train``: SASRec and HSTU (d=64, max_len 50, 2 layers) on a synthetic log of
  1M items (Zipf) and about 10M interactions (200k users, geometric lengths of
  mean 50), with ``ce_chunked`` and ``sampled_softmax_logq``: a fixed number of
  optimiser steps after one warm-up step, timed, extrapolated per million
  targets and to one epoch; peak RSS. The full softmax (``ce``) is shown
  infeasible by arithmetic: its logits alone are ``targets x (items + 1) x 4``
  bytes, and its gradient as many again.
- ``beauty``: the accuracy cost of sampling on Amazon Beauty (SASRec off): full
  softmax, chunked (must match it) and the log-Q sampled softmax, a fixed
  number of epochs each, validation NDCG@10 per epoch and the test metrics.

    python bench/scale_train.py all --out results/perf/scale_train.json
    python bench/scale_train.py report --out results/perf/scale_train.json

``report`` writes ``results/perf/scale_train.md`` from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from common.hardware import cpu_note, peak_rss_gib  # noqa: E402

SCALE = dict(users=200_000, items=1_000_000, mean_len=50.0, max_len=50, d_model=64)
if os.environ.get("SCALE_TRAIN_SMOKE"):  # a quick check of the script itself
    SCALE.update(users=2_000, items=20_000)


# ---------------------------------------------------------------------------- generate
def run_generate(users: int, items: int) -> dict:
    from bft_lightning.datamodules.synthetic import SyntheticConfig, synthetic_arrays

    cfg = SyntheticConfig(num_users=users, num_items=items)
    start = time.perf_counter()
    arrays = synthetic_arrays(cfg)
    seconds = time.perf_counter() - start
    return {"users": users, "items": items, "interactions": int(len(arrays[0])),
            "seconds": seconds, "peak_rss_gib": peak_rss_gib()}  # fmt: skip


# ------------------------------------------------------------------------------- train
def scale_data(users: int, items: int, mean_len: float, max_len: int):
    """The 1M-item synthetic log as the library's arrays (no Python lists on the way)."""
    from bft_lightning.datamodules.splits import SequenceData, leave_one_out, train_arrays
    from bft_lightning.datamodules.synthetic import SyntheticConfig, synthetic_arrays

    cfg = SyntheticConfig(
        num_users=users, num_items=items, lengths="geometric", mean_len=mean_len,
        min_len=3, max_seq_len=200,
    )  # fmt: skip
    flat, offsets, times = synthetic_arrays(cfg)
    data = SequenceData(
        items=flat, offsets=offsets, times=times, num_items=items,
        user_ids=np.arange(1, users + 1).astype(str), item_ids=np.array([""]),  # unused here
    )  # fmt: skip
    split = leave_one_out(data)
    rows = train_arrays(data, split, max_len)
    return data, split, rows


def run_train(model_name: str, loss: str, steps: int, batch_size: int, chunk: int,
              negatives: int) -> dict:  # fmt: skip
    import torch

    from bft_lightning.models import HSTU, SASRec
    from bft_lightning.tasks import SequentialRecommendation

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    s = SCALE
    start = time.perf_counter()
    data, split, rows = scale_data(s["users"], s["items"], s["mean_len"], s["max_len"])
    data_seconds = time.perf_counter() - start
    data_rss = peak_rss_gib()
    cls = {"sasrec": SASRec, "hstu": HSTU}[model_name]
    backbone = partial(cls, d_model=s["d_model"], nhead=2, num_layers=2, dropout=0.2)
    task = SequentialRecommendation(
        s["items"], s["max_len"], backbone=backbone, loss=loss, loss_chunk=chunk,
        num_negatives=negatives, negatives="popularity",
    )  # fmt: skip
    task.criterion.set_item_frequency(torch.from_numpy(split.item_frequency))
    opt = task.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    seq = torch.from_numpy(rows["seq"])
    stamps = torch.from_numpy(rows["seq_time"])
    order = torch.randperm(len(seq), generator=torch.Generator().manual_seed(0))
    labels_per_row = ((seq[:, 1:] > 0) & (seq[:, :-1] > 0)).sum(1)
    epoch_targets = int(labels_per_row.sum())
    times, targets = [], 0
    if steps <= 0:  # the whole epoch: every row once (batch 0 is the warm-up, timed apart)
        steps = -(-len(seq) // batch_size) - 1
    for step in range(steps + 1):  # step 0 warms up
        idx = order[step * batch_size : (step + 1) * batch_size]
        batch = {"seq": seq[idx], "seq_time": stamps[idx]}
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        value = task.training_step(batch, step)
        value.backward()
        opt.step()
        if step:
            times.append(time.perf_counter() - t0)
            targets += int(labels_per_row[idx].sum())
            per_target = float(value) * len(idx) / int(labels_per_row[idx].sum())  # rows-mean
    per_million = sum(times) / targets * 1e6
    return {
        "model": model_name, "loss": loss, "items": s["items"], "users": s["users"],
        "interactions": int(len(data.items)), "epoch_targets": epoch_targets,
        "batch_size": batch_size, "steps": steps, "targets": targets,
        "step_seconds": sum(times) / len(times), "seconds_per_million_targets": per_million,
        "epoch_hours": per_million * epoch_targets / 1e6 / 3600,
        "chunk": chunk, "num_negatives": negatives, "last_loss": per_target,
        "data_seconds": data_seconds, "data_peak_rss_gib": data_rss,
        "peak_rss_gib": peak_rss_gib(), "threads": torch.get_num_threads(),
    }  # fmt: skip


# ------------------------------------------------------------------------------ beauty
def run_beauty(loss: str, epochs: int) -> dict:
    import lightning as L
    import torch

    from bft_lightning.datamodules import SequenceDataModule
    from bft_lightning.models import SASRec
    from bft_lightning.tasks import SequentialRecommendation

    warnings.filterwarnings("ignore")
    L.seed_everything(0, verbose=False)
    dm = SequenceDataModule(
        dataset="amazon-beauty-s3rec", data_root=str(REPO.parent / "shared/data")
    )
    backbone = partial(SASRec, d_model=64, nhead=2, num_layers=2, dropout=0.2, precision="off")
    task = SequentialRecommendation(
        dm.num_items, 50, backbone=backbone, loss=loss, num_negatives=1024,
        negatives="popularity", lr=1e-3,
    )  # fmt: skip

    class Record(L.Callback):
        val: list[float] = []

        def on_validation_end(self, trainer, pl_module) -> None:  # after the module's hooks
            self.val.append(float(trainer.callback_metrics["val/ndcg@10"]))

    record = Record()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[record],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(task, dm)
    seconds = time.perf_counter() - start
    trainer.test(task, dm, verbose=False)
    test = task.test_results
    return {"loss": loss, "epochs": epochs, "val_ndcg@10": record.val,
            "test_hr@10": test["hr@10"], "test_ndcg@10": test["ndcg@10"],
            "fit_seconds": seconds, "threads": torch.get_num_threads(),
            "peak_rss_gib": peak_rss_gib()}  # fmt: skip


# ------------------------------------------------------------------------------ driver
def child(args: list[str]) -> dict:
    """One measurement in a fresh process; its JSON line."""
    out = subprocess.run(
        [sys.executable, __file__, "one", *args], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["all", "generate", "train", "beauty", "report", "one"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--out", default=str(REPO / "results/perf/scale_train.json"))
    parser.add_argument("--beauty-epochs", type=int, default=8)
    a = parser.parse_args()
    if a.what == "one":
        kind, *rest = a.rest
        if kind == "generate":
            res = run_generate(int(rest[0]), int(rest[1]))
        elif kind == "train":
            m, loss, steps, bs, chunk, neg = rest
            res = run_train(m, loss, int(steps), int(bs), int(chunk), int(neg))
        else:
            res = run_beauty(rest[0], int(rest[1]))
        print(json.dumps(res))
        return
    out = Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    if a.what == "report":
        write_report(results, out.with_suffix(".md"))
        return
    results["cpu"] = cpu_note()
    if a.what in ("all", "generate"):
        results["generate"] = [
            child(["generate", "5000", str(n)]) for n in (20_000, 50_000, 100_000, 1_000_000)
        ] + [child(["generate", "200000", "1000000"])]
        out.write_text(json.dumps(results, indent=1))
    if a.what in ("all", "train"):
        runs = []
        for model in ("sasrec", "hstu"):
            steps = os.environ.get("SCALE_TRAIN_STEPS")  # fewer timed steps: "1,5"
            chunked, sampled = steps.split(",") if steps else ("2", "10")
            for args in (["ce_chunked", chunked, "32", "8192", "1"],
                         ["sampled_softmax_logq", sampled, "128", "4096", "2048"]):  # fmt: skip
                runs.append(child(["train", model, *args]))
                out.write_text(json.dumps(results | {"train": runs}, indent=1))
        results["train"] = runs
    if a.what in ("all", "beauty"):
        e = a.beauty_epochs
        results["beauty"] = [
            child(["beauty", "ce", str(e)]),
            child(["beauty", "sampled_softmax_logq", str(e)]),
            child(["beauty", "ce_chunked", "1"]),
        ]
    out.write_text(json.dumps(results, indent=1))
    write_report(results, out.with_suffix(".md"))


def write_report(results: dict, path: Path) -> None:
    """The Markdown summary (numbers from the JSON; the text is in docs/losses.md)."""
    lines = [
        "# Training at a catalogue's scale",
        "",
        "Written by `bench/scale_train.py report` from `scale_train.json`. Commands:",
        "generator `python bench/scale_train.py generate`;",
        "1M-item training `SCALE_TRAIN_STEPS=1,4 OMP_NUM_THREADS=1 python bench/scale_train.py",
        "train`; Beauty `python bench/scale_train.py one beauty <loss> <epochs>` (`all`",
        "runs the three). Each measurement is a fresh process; peak RSS is its `VmHWM`.",
        "The host is shared with other jobs: times are indicative.",
        "",
        f"CPU: {results.get('cpu', '?')}; torch threads: "
        f"{(results.get('train') or [{}])[0].get('threads', '?')}.",
        "",
    ]
    notes = results.get("notes", [])
    if notes:
        lines += ["## Goals and measured", "", *notes, ""]
    gen = results.get("generate", [])
    if gen:
        lines += ["## Synthetic generator", "", "| users | items | interactions | seconds | "
                  "peak RSS GiB |", "|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {g['users']:,} | {g['items']:,} | {g['interactions']:,} | "
                  f"{g['seconds']:.2f} | {g['peak_rss_gib']:.2f} |" for g in gen]  # fmt: skip
        lines.append("")
    train = results.get("train", [])
    if train:
        lines += ["## 1M items, ~10M interactions", "",
                  "| model | loss | batch rows | steps timed | s / step | s / 1M targets | "
                  "epoch (h, extrapolated) | peak RSS GiB |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {t['model']} | {t['loss']} | {t['batch_size']} | {t['steps']} | "
                  f"{t['step_seconds']:.2f} | {t['seconds_per_million_targets']:.0f} | "
                  f"{t['epoch_hours']:.2f} | {t['peak_rss_gib']:.2f} |" for t in train]  # fmt: skip
        t = train[0]
        full = 4 * (t["items"] + 1)
        lines += ["", f"Interactions {t['interactions']:,}, training targets per epoch "
                  f"{t['epoch_targets']:,}. Full softmax (`ce`): its logits are "
                  f"targets x {t['items'] + 1:,} x 4 B = {full / 2**20:.1f} MiB per target, "
                  f"{full * 6400 / 2**30:.0f} GiB for a batch of 128 rows of 50 targets, "
                  "twice that with their gradient: not run.", ""]  # fmt: skip
    beauty = results.get("beauty", [])
    if beauty:
        lines += ["## Amazon Beauty, SASRec off", "", "| loss | epochs | val NDCG@10 by epoch | "
                  "test HR@10 | test NDCG@10 | fit s |", "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {b['loss']} | {b['epochs']} | "
                  + ", ".join(f"{v:.4f}" for v in b["val_ndcg@10"])
                  + f" | {b['test_hr@10']:.4f} | {b['test_ndcg@10']:.4f} | {b['fit_seconds']:.0f} |"
                  for b in beauty]  # fmt: skip
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
