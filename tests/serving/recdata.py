"""A tiny, perfectly predictable dataset and a checkpoint trained on it through the CLI.

Users walk a cycle of 20 items (raw ids 1001..1020): the item after ``a`` is
always ``a + 1`` (1020 -> 1001), so a trained model's top item after any
history is known.
"""

from __future__ import annotations

import random
from pathlib import Path

import yaml

NUM_ITEMS, FIRST = 20, 1001


def successor(item: int | str) -> str:
    return str(FIRST + (int(item) - FIRST + 1) % NUM_ITEMS)


def write_cyclic(path: Path, users: int = 300, seed: int = 0) -> Path:
    """S3-Rec lines ``user item item ...``: each user a run of 6..13 consecutive items."""
    rng = random.Random(seed)
    lines = []
    for u in range(users):
        start, n = rng.randrange(NUM_ITEMS), rng.randrange(6, 14)
        items = [str(FIRST + (start + j) % NUM_ITEMS) for j in range(n)]
        lines.append(" ".join([str(u + 1), *items]))
    path.write_text("\n".join(lines) + "\n")
    return path


def config(path: Path, data: Path, root: Path, max_epochs: int = 12, **backbone) -> Path:
    """A fit/test/predict config: SASRec d=16 on ``data``, best checkpoint in ``root/ckpt``."""
    opts = dict(d_model=16, nhead=2, num_layers=1, dim_feedforward=32, dropout=0.0)
    opts.update(backbone)
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_epochs": max_epochs, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False,
            "default_root_dir": str(root / "run"), "num_sanity_val_steps": 0,
            "callbacks": [{
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": str(root / "ckpt"), "filename": "best",
                              "monitor": "val/ndcg@10", "mode": "max"},
            }],
        },
        "model": {
            "class_path": "bft_lightning.tasks.SequentialRecommendation",
            "init_args": {"lr": 0.01, "backbone": {
                "class_path": "bft_lightning.models.SASRec", "init_args": opts}},
        },
        "data": {
            "class_path": "bft_lightning.datamodules.SequenceDataModule",
            "init_args": {"path": str(data), "max_len": 8, "batch_size": 64},
        },
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(root: Path) -> tuple[Path, Path, Path]:
    """(checkpoint, data file, config) of a model fit on the cyclic data via the CLI."""
    from bft_lightning.cli import main

    root.mkdir(parents=True, exist_ok=True)
    data = write_cyclic(root / "cyclic.txt")
    cfg = config(root / "config.yaml", data, root)
    main(["fit", "--config", str(cfg)])
    return root / "ckpt" / "best.ckpt", data, cfg


def cli_test_metrics(cfg: Path, ckpt: Path, *extra: str) -> dict[str, float]:
    """``python -m bft_lightning test --config cfg --ckpt_path ckpt``'s metrics."""
    from bft_lightning.cli import main

    cli = main(["test", "--config", str(cfg), "--ckpt_path", str(ckpt), *extra])
    return dict(cli.model.test_results)
