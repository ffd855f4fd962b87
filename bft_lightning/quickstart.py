"""The quick start: SASRec with and without BFT on the built-in synthetic data.

``make quickstart`` runs this module. Both runs use the shipped experiment
configs (``configs/experiments/sasrec_{off,on}_synthetic.yaml``), train until
validation NDCG@10 stops improving (at most 20 epochs), test the best
checkpoint, and print the two metric tables side by side with the strata.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bft_lightning.cli import main
from bft_lightning.metrics import compare_table

KEYS = ("hr@10", "ndcg@10", "mrr", "gain")


def configs_dir() -> Path:
    """``configs/experiments`` of the working directory, else of the source tree."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (base / "configs" / "experiments").is_dir():
            return base / "configs" / "experiments"
    raise FileNotFoundError(
        "configs/experiments not found in the working directory or next to the package: "
        "run the quick start from the repository's root"
    )


def run(variant: str, backbone: str, dataset: str, max_epochs: int | None) -> tuple[dict, str]:
    """Fit and test one configuration; returns its test metrics and log directory."""
    args = ["--config", str(configs_dir() / f"{backbone}_{variant}_{dataset}.yaml")]
    args += ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    if max_epochs is not None:
        args.append(f"--trainer.max_epochs={max_epochs}")
    cli = main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # the best validation checkpoint; a run too short to validate tests its last weights
    best = getattr(cli.trainer.checkpoint_callback, "best_model_path", "")
    cli.trainer.test(
        cli.model, datamodule=cli.datamodule, ckpt_path="best" if best else None, verbose=False
    )
    return cli.model.test_results, str(cli.trainer.log_dir)


def strata_rows(metrics: dict[str, dict]) -> dict[str, dict]:
    """Keep the headline metrics, overall and per stratum, for the side-by-side table."""
    return {
        name: {k: v for k, v in m.items() if k.split("/")[-1] in KEYS or k.endswith("/n")}
        for name, m in metrics.items()
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backbone", default="sasrec", choices=["sasrec", "bert4rec", "hstu"])
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--max-epochs", type=int, default=None)
    opts = parser.parse_args()
    sys.argv = sys.argv[:1]  # parsed here: the CLI gets its arguments from run()
    results, dirs = {}, {}
    for variant in ("off", "on"):
        results[variant], dirs[variant] = run(variant, opts.backbone, opts.dataset, opts.max_epochs)
    print(f"\n## {opts.backbone} on {opts.dataset}: precision off vs on (test, full ranking)\n")
    print(compare_table(strata_rows(results)))
    print(
        "\nitem_q0 = rarest quarter of items by training frequency; user_b0 = shortest histories."
    )
    for variant, d in dirs.items():
        print(f"precision={variant}: logs, metrics.md and strata.png in {d}")
    print("TensorBoard: tensorboard --logdir logs")


if __name__ == "__main__":
    cli()
