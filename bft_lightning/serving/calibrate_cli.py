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

Bad input stops with one ``error:`` line and exit status 2. Serving never
builds a LightningCLI: for ``--config`` the command line builds the data
module and hands it in (``main(argv, build_data=...)``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cli import InputError, read_histories
from .recommender import Recommender

BuildData = Callable[[str, list[str]], Any]  # (config, overrides) -> a data module

__all__ = ["main", "parser", "run", "validation_users"]


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
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument(
        "--allow-other-data",
        "--allow_other_data",
        dest="allow_other_data",
        action="store_true",
        help="calibrate on data that is not the checkpoint's training data",
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def main(argv: list[str] | None = None, build_data: BuildData | None = None) -> int:
    """Run ``calibrate``; returns the exit status (2 on bad input).

    ``build_data(config, overrides)`` builds the data module of ``--config``
    (the command line passes its own builder; serving does not import it).
    """
    from bft_lightning.utils.errors import debug_requested

    debug, rest = debug_requested(list(sys.argv[1:] if argv is None else argv))
    opts, extra = parser().parse_known_args(rest)
    if extra and not opts.config:
        parser().error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        summary = run(opts, extra, build_data)
    except (InputError, ValueError) as err:
        if debug:
            raise
        print(f"error: {str(err).removeprefix('error: ')}", file=sys.stderr)
        return 2
    print(summary, file=sys.stderr)
    return 0


def run(
    opts: argparse.Namespace, extra: list[str] | None = None, build_data: BuildData | None = None
) -> str:
    from bft_lightning.utils.devices import check_device
    from bft_lightning.utils.outputs import check_output

    replaced = False
    if opts.output is not None:
        replaced = check_output(
            opts.output, [opts.ckpt_path, opts.config, opts.input], opts.overwrite
        )
    if opts.config and not Path(opts.config).is_file():
        what = "is a directory" if Path(opts.config).is_dir() else "file not found"
        raise InputError(f"--config {opts.config}: {what}")
    if opts.config and build_data is None:
        raise InputError("--config needs the command line: python -m bft_lightning calibrate")
    check_device(opts.device, "--device")
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
            assert build_data is not None
            dm = build_data(opts.config, extra or [])
            rows, targets, times = validation_users(dm, opts.ckpt_path, opts.allow_other_data)
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
            _check_known(rec, opts.input, histories, targets_raw, opts.allow_other_data)
            timed = any(t is not None for t in stamps)
            report = rec.calibrate(histories, targets_raw, k, times=stamps if timed else None)
            report["left_out"] += short
    except ValueError as err:
        raise InputError(str(err)) from None
    out = rec.save_calibration(opts.ckpt_path, opts.output)
    cal = rec.calibration
    assert cal is not None
    where = f"{out} (replaced the existing file: --overwrite)" if replaced else f"{out}"
    return (
        f"calibrate: P(hit@{k}) fit on {report['users']} users ({report['left_out']} left out), "
        f"hit rate {report['hit_rate']:.4f}, AUROC {report['auroc']:.4f} (in-sample), features "
        f"{', '.join(cal.features)}; written to {where}"
    )


def _check_known(
    rec: Recommender, source: str, histories: list[list[str]], targets: list[str], allow: bool
) -> None:
    """Refuse held-out histories whose item ids the checkpoint mostly does not know."""
    from bft_lightning.datamodules.data_match import MIN_OVERLAP

    ids = [i for h in histories for i in h] + list(targets)
    known = sum(str(i).strip() in rec.index for i in ids)
    share = known / len(ids) if ids else 1.0
    if share < MIN_OVERLAP and not allow:
        what = "none" if known == 0 else f"only {share:.0%}"
        raise InputError(
            f"{source}: the data's item ids do not match the checkpoint's: {what} of its "
            f"{len(ids)} item ids are known to the checkpoint ({rec.num_items} items); "
            "pass --allow-other-data if this is meant"
        )


def validation_users(
    dm: Any, ckpt_path: str, allow_other_data: bool = False
) -> tuple[list[list[int]], list[int], list[list[int]] | None]:
    """The validation users of data module ``dm`` encoded in ``ckpt_path``'s vocabulary:
    histories, targets (the checkpoint's item indices) and timestamps (None when the
    data has none). Other data than the checkpoint's is refused unless allowed."""
    from bft_lightning.datamodules.vocabulary import read_vocabulary

    vocabulary = read_vocabulary(ckpt_path)
    use = getattr(dm, "use_vocabulary", None)
    if not callable(use) or vocabulary is None:
        raise InputError(f"--config: its data module has no item vocabulary to map ({ckpt_path})")
    if allow_other_data and hasattr(dm, "allow_other_data"):
        dm.allow_other_data = True
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
