"""Training throughput: sequences per second and seconds per epoch, off and on.

For each backbone (SASRec, BERT4Rec, HSTU) and ``precision`` off / on, builds
the Amazon Beauty experiment from ``configs/experiments/<backbone>_<p>_beauty.yaml``
(the same model, data, batch size and optimiser as the reported runs), trains
``--warmup`` untimed optimiser steps, then times one epoch's worth of steps
(as many as an epoch has batches; ``--steps N`` times N instead) and reports

- sequences/s over the timed steps (training sequences, i.e. the batch size),
- seconds per epoch = the summed step and data-wait times of the timed steps
  (scaled to an epoch's batches when ``--steps`` is given). Batches are
  bucketed by history length and trimmed to their longest row, so step times
  differ ~20x within an epoch: a median or a short window of steps says
  little about an epoch,
- the share of the time spent waiting for the next batch (data pipeline),
- with ``--compile``, the same for the backbone compiled by ``torch.compile``.

    OMP_WAIT_POLICY=PASSIVE python bench/train_throughput.py                    # all six
    OMP_WAIT_POLICY=PASSIVE python bench/train_throughput.py --backbones sasrec --compile

Writes ``results/perf/train_throughput.md`` (the whole file: tables kept from
earlier runs there must be copied back by hand). Not a test: numbers depend
on the machine and its load; the on/off ratios come from one invocation,
each twin's fastest of its ``--repeats`` passes (not necessarily the same
pass for both).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.hardware import device_name, threads  # noqa: E402

from bft_lightning.cli import main as cli_main  # noqa: E402
from bft_lightning.metrics.report import write_text_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "results" / "perf" / "train_throughput.md"


class StepTimer(L.Callback):
    """Per-step compute time and the wait for data between steps, after ``warmup`` steps.

    Steps are counted over the whole run (an epoch's worth of timed steps crosses
    into the next epoch). ``steps`` = 0 times as many steps as an epoch has
    batches, set once the trainer knows that number.
    """

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.step: list[float] = []
        self.wait: list[float] = []
        self._end: float | None = None
        self._start = 0.0
        self._count = 0

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        if self.steps == 0:
            self.steps = int(trainer.num_training_batches)
        trainer.fit_loop.epoch_loop.max_steps = self.warmup + self.steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        _sync(pl_module)
        self._start = time.perf_counter()
        if self._end is not None and self._count >= self.warmup:  # the wait before a timed step
            self.wait.append(self._start - self._end)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        _sync(pl_module)
        self._end = time.perf_counter()
        if self._count >= self.warmup:
            self.step.append(self._end - self._start)
        self._count += 1


def _sync(module: torch.nn.Module) -> None:
    """Wait for queued GPU work, so that a step's time is its own."""
    if module.device.type == "cuda":
        torch.cuda.synchronize(module.device)


def measure(backbone: str, precision: str, compile_: bool, args: argparse.Namespace) -> dict:
    config = ROOT / "configs" / "experiments" / f"{backbone}_{precision}_beauty.yaml"
    argv = [
        "--config", str(config), "--trainer.max_steps=-1", "--trainer.max_epochs=1000",
        "--trainer.limit_val_batches=0", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.callbacks=[]",
        f"--trainer.default_root_dir={ROOT / 'logs' / 'throughput'}",
        f"--data.init_args.data_root={args.data_root}", f"--model.init_args.compile={compile_}",
    ]  # fmt: skip
    if args.accelerator:
        argv.append(f"--trainer.accelerator={args.accelerator}")
    cli = cli_main(argv, run=False)
    timer = StepTimer(args.warmup, args.steps)
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    step, wait = sum(timer.step), sum(timer.wait)
    n = len(timer.step)
    if n == 0:
        raise RuntimeError(f"{backbone} {precision}: no step was timed (warm-up {args.warmup})")
    batches = int(cli.trainer.num_training_batches)
    batch_size = cli.datamodule.batch_size
    return {
        "backbone": backbone, "precision": precision, "compile": compile_,
        "seq_per_s": n * batch_size / (step + wait),
        "sec_per_epoch": (step + wait) * batches / n, "timed_steps": n, "batches": batches,
        "wait_share": wait / (step + wait), "step_ms": 1e3 * step / n,
        "hardware": _hardware(cli.trainer.strategy.root_device),
    }  # fmt: skip


def _hardware(device: torch.device) -> str:
    name = device_name(device)
    return f"{name} ({threads()} on the host)" if name else threads()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backbones", nargs="+", default=["sasrec", "bert4rec", "hstu"])
    p.add_argument(
        "--steps", type=int, default=0, help="timed optimiser steps (0: an epoch's worth)"
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--compile", action="store_true", help="also time the compiled backbone")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each configuration, mirrored order; fastest counts",
    )
    p.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--accelerator", default=None, help="override the config's (cpu, gpu)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args()
    configs = [
        (backbone, precision, compile_)
        for backbone in args.backbones
        for precision in ("off", "on")
        for compile_ in ((False, True) if args.compile else (False,))
    ]
    best: dict[tuple, dict] = {}
    for r in range(args.repeats):  # mirrored order: a load change hits both twins alike
        for config in configs if r % 2 == 0 else configs[::-1]:
            result = measure(*config, args)
            print(result, flush=True)
            if config not in best or result["sec_per_epoch"] < best[config]["sec_per_epoch"]:
                best[config] = result
    rows = [best[c] for c in configs]
    lines = [
        "| backbone | precision | compiled | step ms | sequences/s | s/epoch | data wait "
        "| on/off time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        off = next(x for x in rows if x["backbone"] == r["backbone"] and x["precision"] == "off"
                   and x["compile"] == r["compile"])  # fmt: skip
        lines.append(
            f"| {r['backbone']} | {r['precision']} | {'yes' if r['compile'] else 'no'} "
            f"| {r['step_ms']:.0f} | {r['seq_per_s']:.0f} | {r['sec_per_epoch']:.1f} "
            f"| {100 * r['wait_share']:.1f}% | {r['sec_per_epoch'] / off['sec_per_epoch']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    cmd = "OMP_WAIT_POLICY=PASSIVE python bench/train_throughput.py " + " ".join(
        f"--backbones {' '.join(args.backbones)}".split()
        + [f"--steps {args.steps}", f"--warmup {args.warmup}", f"--repeats {args.repeats}"]
        + (["--compile"] if args.compile else [])
        + ([f"--accelerator {args.accelerator}"] if args.accelerator else [])
        + ([f"--out {args.out}"] if Path(args.out).resolve() != DEFAULT_OUT else [])
    )
    machine = ", ".join(sorted({r["hardware"] for r in rows}))
    write_text_atomic(
        Path(args.out),
        "# Training throughput on Amazon Beauty\n\n"
        f"Command: `{cmd}`\n\n"
        f"Machine: {machine}, torch {torch.__version__}. "
        + ("One epoch's worth of steps timed" if args.steps == 0 else f"{args.steps} steps timed")
        + f" after {args.warmup} untimed ones; step ms = mean step; s/epoch = the timed "
        "steps' summed step and data-wait times"
        + ("" if args.steps == 0 else ", scaled to an epoch's batches")
        + f"; each configuration ran {args.repeats} times in mirrored order and the "
        "fastest run counts.\n\n"
        f"{table}\n",
    )


if __name__ == "__main__":
    main()
