"""``python -m bft_lightning calibrate --ckpt_path CKPT (--config CFG | --input FILE)``.

Fits the checkpoint's confidence on held-out users, so that every later
``recommend`` / ``Recommender`` list carries ``P(the next item is among its
first k)`` (``docs/confidence.md``), and writes it into the checkpoint
(atomically, with a new digest; ``--output`` writes a copy instead).

- ``--config CFG``: the users of the configured data's validation split (their
  history before the validation item, the item as the target), encoded
  through the checkpoint's own vocabulary. Pass the same config (and
  overrides such as ``--data.init_args.data_root``) the model was trained with.
- ``--input FILE``: held-out histories in ``recommend``'s input formats (JSON
  lines or CSV); each history's last item is its target, the items before it
  the history. Histories with fewer than 2 items are left out and counted.

Bad input stops with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .cli import InputError, read_histories
from .recommender import CHECKPOINT_KEY, Recommender

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bft_lightning calibrate",
        description="Fit a checkpoint's confidence to P(hit@k) on held-out users.",
    )
    p.add_argument("--ckpt_path", required=True, help="a SequentialRecommendation checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="the training config: calibrate on its validation users")
    src.add_argument("--input", help="held-out histories (.jsonl / .csv); last item = target")
    p.add_argument("--k", type=int, default=10, help="the list length P(hit@k) is for (10)")
    p.add_argument("--output", default=None, help="write a calibrated copy (default: in place)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--input-format", choices=("jsonl", "csv"), default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``calibrate``; returns the exit status (2 on bad input)."""
    opts, extra = parser().parse_known_args(argv)
    if extra and not opts.config:
        parser().error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        summary = run(opts, extra)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary, file=sys.stderr)
    return 0


def run(opts: argparse.Namespace, extra: list[str] | None = None) -> str:
    try:
        rec = Recommender.from_checkpoint(opts.ckpt_path, device=opts.device)
    except (ValueError, FileNotFoundError) as err:
        raise InputError(f"--ckpt_path {err}") from None
    try:
        k = rec.check_k(opts.k)
        if k >= rec.num_items:
            raise ValueError(f"must be below the item count ({rec.num_items})")
    except ValueError as err:
        raise InputError(f"--k {opts.k}: {err}") from None
    try:
        if opts.config:
            rows, targets, times = _validation_users(opts.config, opts.ckpt_path, extra or [])
            report = rec.calibrate_encoded(rows, targets, k, times=times)
        else:
            histories, targets_raw, stamps, short = [], [], [], 0
            for h in read_histories(opts.input, opts.input_format):
                if len(h.items) < 2:
                    short += 1
                    continue
                histories.append(h.items[:-1])
                targets_raw.append(h.items[-1])
                stamps.append(None if h.times is None else h.times[:-1])
            timed = any(t is not None for t in stamps)
            report = rec.calibrate(histories, targets_raw, k, times=stamps if timed else None)
            report["left_out"] += short
    except ValueError as err:
        raise InputError(str(err)) from None
    out = rec.save_calibration(opts.ckpt_path, opts.output)
    cal = rec.calibration
    assert cal is not None
    return (
        f"calibrate: P(hit@{k}) fit on {report['users']} users ({report['left_out']} left out), "
        f"hit rate {report['hit_rate']:.4f}, AUROC {report['auroc']:.4f} (in-sample), features "
        f"{', '.join(cal.features)}; written to {out}"
    )


def _validation_users(
    config: str, ckpt_path: str, overrides: list[str]
) -> tuple[list[list[int]], list[int], list[list[int]] | None]:
    """The validation users' histories, targets (the checkpoint's item indices) and
    timestamps (None when the data has none)."""
    from bft_lightning.cli import main as cli_main
    from bft_lightning.utils.checkpoint_io import safe_load_checkpoint

    if not Path(config).is_file():
        raise InputError(f"--config {config}: file not found")
    cli: Any = cli_main(["--config", config, "--trainer.logger=false",
                         "--trainer.enable_progress_bar=false", *overrides],
                        run=False)  # fmt: skip
    dm = cli.datamodule
    vocabulary = (safe_load_checkpoint(ckpt_path).get(CHECKPOINT_KEY) or {}).get("vocabulary")
    use = getattr(dm, "use_vocabulary", None)
    if not callable(use):
        raise InputError(f"--config {config}: its data module has no item vocabulary to map")
    use(vocabulary, ckpt_path)
    dm.setup("validate")
    rows: list[list[int]] = []
    targets: list[int] = []
    times: list[list[int]] = []
    timed = False
    for batch in dm.val_dataloader():
        ids, target, stamps = batch["input_ids"], batch["target"], batch.get("input_time")
        timed = stamps is not None
        for r in range(len(ids)):
            keep = ids[r] > 0
            row = ids[r][keep].tolist()
            if row:
                rows.append(row)
                targets.append(int(target[r]))
                times.append(stamps[r][keep].tolist() if stamps is not None else [])
    return rows, targets, times if timed else None
