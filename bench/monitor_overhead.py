"""Step-time overhead of ``PrecisionMonitor`` at its default interval.

A small SASRec-like BFT model (causal, d=64, 2 layers, T=50, batch 64)
trains on CPU with the monitor switched on and off in alternating blocks of
one logging interval (``every_n_steps``, 50 by default) inside one run: off,
on, off, on, ... An "on" block runs the monitor's hooks and so holds exactly
one logged step, as every interval does in real use; an "off" block runs
as without the monitor. Interleaving in blocks keeps both conditions under
the same machine load, which on a shared machine drifts far more than the
effect. A step's time is the wall time from one ``on_train_batch_start`` to
the next, so it includes the monitor's work at the batch end.

Printed: the median step time of each condition, the overhead (the ratio of
mean step times of adjacent on / off blocks, median over the pairs: the
total cost, logged steps included), and the time the monitor spends in its
own hooks per logged step (a noise-free lower bound of its cost).

    OMP_WAIT_POLICY=PASSIVE python bench/monitor_overhead.py
    OMP_WAIT_POLICY=PASSIVE python bench/monitor_overhead.py --pairs 20 --threads 1

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from bft_lightning.callbacks import PrecisionMonitor
from bft_lightning.nn import BFTEncoder, BFTEncoderLayer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=10, help="(off, on) block pairs timed")
    p.add_argument("--every-n-steps", type=int, default=PrecisionMonitor().every_n_steps)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=50)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--items", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


class SeqRec(LightningModule):
    """Next-item prediction with a causal BFT encoder (left-padded sequences)."""

    def __init__(self, items: int, d_model: int, length: int) -> None:
        super().__init__()
        self.item = nn.Embedding(items + 1, d_model, padding_idx=0)
        self.pos = nn.Embedding(length, d_model)
        layer = BFTEncoderLayer(d_model, 2, dim_feedforward=4 * d_model, dropout=0.1)
        self.encoder = BFTEncoder(layer, 2, norm=nn.LayerNorm(d_model))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (seq,) = batch
        x, y = seq[:, :-1], seq[:, 1:]
        h = self.item(x) + self.pos.weight[: x.shape[1]]
        h = self.encoder(h, src_key_padding_mask=x == 0, is_causal=True)
        logits = h @ self.item.weight.T  # (B, T, items + 1)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=0)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Blocks(Callback):
    """Times every step; runs the monitor's training hooks in odd blocks of n steps only."""

    def __init__(self, monitor: PrecisionMonitor) -> None:
        self.monitor, self.n = monitor, monitor.every_n_steps
        self.starts: dict[int, float] = {}
        self.hook_seconds = 0.0
        self.active = False

    def on_monitor_block(self, step: int) -> bool:
        return (step // self.n) % 2 == 1

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.monitor.setup(trainer, pl_module, stage)

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.starts[trainer.global_step] = time.perf_counter()
        self.active = self.on_monitor_block(trainer.global_step)
        if self.active:
            self._timed(self.monitor.on_train_batch_start, trainer, *args)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.active:
            self._timed(self.monitor.on_train_batch_end, trainer, *args)

    def _timed(self, hook: Any, *args: Any) -> None:
        t = time.perf_counter()
        hook(*args)
        self.hook_seconds += time.perf_counter() - t

    def block_times(self, block: int) -> list[float]:
        steps = range(block * self.n, (block + 1) * self.n)
        return [self.starts[s + 1] - self.starts[s] for s in steps]


def data(args: argparse.Namespace) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = args.batch * 64
    seq = torch.randint(1, args.items + 1, (n, args.length + 1), generator=g)
    lengths = torch.randint(2, args.length + 2, (n, 1), generator=g)
    seq[torch.arange(args.length + 1) < args.length + 1 - lengths] = 0  # left padding
    return DataLoader(TensorDataset(seq), batch_size=args.batch, shuffle=True, drop_last=True)


def run(args: argparse.Namespace, root: str) -> Blocks:
    """Train 1 warm-up block, then ``pairs`` (off, on) block pairs, timing every step."""
    torch.manual_seed(0)
    n = args.every_n_steps
    blocks = Blocks(PrecisionMonitor(every_n_steps=n))
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=n * (2 * args.pairs + 1) + 1,
        callbacks=[blocks], logger=TensorBoardLogger(root, name="bench"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=n,
    )  # fmt: skip
    trainer.fit(SeqRec(args.items, args.d_model, args.length), data(args))
    return blocks


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as root:
        blocks = run(args, root)
    n, logged = args.every_n_steps, blocks.monitor.num_logged
    # block 0 is warm-up; block 2k is off, 2k + 1 on; compare every adjacent pair
    times = {b: blocks.block_times(b) for b in range(1, 2 * args.pairs + 1)}
    ratios = []
    for b in range(2, 2 * args.pairs + 1):
        on, off = (b, b - 1) if blocks.on_monitor_block(b * n) else (b - 1, b)
        ratios.append(statistics.fmean(times[on]) / statistics.fmean(times[off]))
    off_steps = [t for b, ts in times.items() if not blocks.on_monitor_block(b * n) for t in ts]
    on_steps = [t for b, ts in times.items() if blocks.on_monitor_block(b * n) for t in ts]
    print(
        f"model d={args.d_model}, T={args.length}, batch {args.batch}, {args.threads} threads, "
        f"every_n_steps={n}, {args.pairs} block pairs ({len(off_steps) + len(on_steps)} steps)"
    )
    print(f"median step time without monitor: {statistics.median(off_steps) * 1e3:.2f} ms")
    print(f"median step time with monitor:    {statistics.median(on_steps) * 1e3:.2f} ms")
    step = statistics.median(off_steps)
    per_log = blocks.hook_seconds / max(logged, 1)
    print(
        f"monitor hooks per logged step:    {per_log * 1e3:.2f} ms "
        f"(= {per_log / (n * step):.2%} of {n} steps; {logged} logged)"
    )
    q = statistics.quantiles(ratios, n=4)
    print(
        f"total overhead (on / off mean step time, median of {len(ratios)} adjacent blocks): "
        f"{statistics.median(ratios) - 1:+.2%} (quartiles {q[0] - 1:+.2%}, {q[2] - 1:+.2%})"
    )


if __name__ == "__main__":
    main()
