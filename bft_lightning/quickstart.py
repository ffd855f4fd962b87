"""The quick start: SASRec with and without BFT on the built-in synthetic data.

``make quickstart`` runs this module. Both runs use the shipped experiment
configs (``configs/experiments/{backbone}_{off,on}_{dataset}.yaml``) with a
training batch of 64 (``--batch-size``: more steps an epoch on the small data),
validate every epoch and train until early stopping on validation NDCG@10 has
converged (``--patience`` validations without a gain of ``--min-delta``), within
``--max-epochs``; a run that reaches the cap first is reported as cut short. Each tests its best
checkpoint. The end is one table, off against on on the same test users,
overall and per stratum with n, and the paired difference (on - off) with its
standard error over users; and one figure with both runs side by side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bft_lightning.cli import main
from bft_lightning.utils.errors import run_with_clear_errors

VARIANTS = ("off", "on")


def configs_dir() -> Path:
    """``configs/experiments`` of the working directory, else of the source tree."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (base / "configs" / "experiments").is_dir():
            return base / "configs" / "experiments"
    raise FileNotFoundError(
        "configs/experiments not found in the working directory or next to the package: "
        "run the quick start from the repository's root"
    )


def run(variant: str, backbone: str, dataset: str, opts: argparse.Namespace) -> dict[str, Any]:
    """Fit and test one configuration; its test metric, log folder and stop reason."""
    from bft_lightning.callbacks.summary import stop_reason

    print(f"\n=== {backbone} precision={variant} on {dataset} ===", flush=True)
    args = ["--config", str(configs_dir() / f"{backbone}_{variant}_{dataset}.yaml")]
    args += ["--trainer.enable_model_summary=false", f"--trainer.max_epochs={opts.max_epochs}"]
    args += [
        "--trainer.check_val_every_n_epoch=1",
        f"--data.init_args.batch_size={opts.batch_size}",
    ]
    cli = main([*args, *opts.extra], run=False)
    for callback in cli.trainer.callbacks:  # type: ignore[attr-defined]
        if type(callback).__name__ == "EarlyStopping":
            callback.patience = opts.patience
            callback.min_delta = opts.min_delta if callback.mode == "max" else -opts.min_delta
        if type(callback).__name__ == "RunSummary":
            callback.test_table = False  # the one table is the paired one at the end
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    converged, reason = stop_reason(cli.trainer)
    best = getattr(cli.trainer.checkpoint_callback, "best_model_path", "")
    # the best validation checkpoint; a run too short to validate tests its last weights
    cli.trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path=best or None, verbose=False)
    return {
        "metric": cli.model.test_metric,
        "log_dir": str(cli.trainer.log_dir),
        "converged": converged,
        "reason": reason,
        "epochs": cli.trainer.current_epoch,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bft_lightning.quickstart",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backbone", default="sasrec", choices=["sasrec", "bert4rec", "hstu"])
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument(
        "--max-epochs", type=int, default=40, help="the cap per run (default 40)"
    )  # fmt: skip
    parser.add_argument(
        "--patience", type=int, default=3,
        help="validations without an improvement of --min-delta before stopping (default 3)",
    )  # fmt: skip
    parser.add_argument(
        "--min-delta", type=float, default=0.002,
        help="the least gain in validation NDCG@10 that counts as one (default 0.002)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=int, default=64,
        help="training batch (default 64: 31 steps an epoch on the 2000 synthetic users)",
    )  # fmt: skip
    parser.add_argument("--out", default="logs", help="where the table and figure go")
    parser.add_argument("--debug", action="store_true", help="full tracebacks")
    opts, extra = parser.parse_known_args(argv)
    if opts.max_epochs < 1 or opts.patience < 1 or opts.batch_size < 1:
        parser.error("--max-epochs, --patience and --batch-size must be >= 1")
    if not opts.min_delta >= 0:
        parser.error(f"--min-delta must be >= 0, got {opts.min_delta}")
    opts.extra = extra  # handed to the CLI, e.g. --data.init_args.synthetic_users=500
    return opts


def quickstart(argv: list[str]) -> None:
    from bft_lightning.metrics.paired import paired_figure, paired_rows, paired_table, per_user

    opts = parse(argv)
    sys.argv = sys.argv[:1]  # parsed here: the CLI gets its arguments from run()
    runs = {v: run(v, opts.backbone, opts.dataset, opts) for v in VARIANTS}
    rows = paired_rows(per_user(runs["off"]["metric"]), per_user(runs["on"]["metric"]))
    title = f"{opts.backbone} on {opts.dataset}: precision off vs on (test, full ranking)"
    figure = Path(opts.out) / f"quickstart_{opts.backbone}_{opts.dataset}.png"
    paired_figure(rows, VARIANTS, figure, title)
    table = paired_table(rows, VARIANTS)
    (Path(opts.out) / f"quickstart_{opts.backbone}_{opts.dataset}.md").write_text(
        f"# {title}\n\n{table}"
    )
    print(f"\n## {title}\n")
    print(table)
    print(
        "on − off: the mean over the same test users of (on − off), ± its standard error "
        "sd/sqrt(n).\nitem Q0 = targets among the rarest quarter of items by training "
        "frequency; user B0 = shortest histories. mean K: Kalman gain at the predicting "
        "position (BFT only)."
    )
    for variant, r in runs.items():
        print(f"precision={variant}: {r['reason']}")
        print(f"  logs, checkpoints, metrics.md in {r['log_dir']}")
    print(f"figure: {figure}\nTensorBoard: tensorboard --logdir {opts.out}")


def cli() -> None:
    from bft_lightning.utils.errors import debug_requested
    from bft_lightning.utils.noise import quiet_third_party

    argv = sys.argv[1:]
    if not debug_requested(argv)[0]:
        quiet_third_party()
    code = run_with_clear_errors(quickstart, argv)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    cli()
