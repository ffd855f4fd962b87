"""``python -m bft_lightning export --ckpt_path best.ckpt --output model_onnx``.

Writes ``model.onnx`` (history in, user vector and per-user scale out), the item
table and bias (``items.npy``, ``item_bias.npy``), the raw ids
(``vocabulary.json``) and how to score with them (``export.json``) into the
folder ``--output`` (``docs/serving.md``). The graph is checked under
onnxruntime against PyTorch before the command succeeds. A backbone that
cannot be exported, a bad checkpoint or an output that would replace it stop
with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from .serve_cli import missing_extra

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bft_lightning export",
        description="Export a checkpoint's encoder to ONNX, with its item table and vocabulary.",
    )
    p.add_argument("--ckpt_path", required=True, help="a SequentialRecommendation checkpoint")
    p.add_argument("--output", required=True, help="the folder to write (created if needed)")
    p.add_argument(
        "--overwrite", action="store_true",
        help="replace the files of an earlier export in --output (never the checkpoint)",
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``export``; returns the exit status (2 with one ``error:`` line on bad input)."""
    opts = parser().parse_args(argv)
    missing = missing_extra("onnx", "onnxruntime")
    if missing:
        print(missing, file=sys.stderr)
        return 2
    from .export import export, output_files
    from .recommender import Recommender

    try:  # before any work: never over the checkpoint, an earlier export only if asked
        output_files(opts.output, opts.ckpt_path, opts.overwrite)
    except ValueError as err:
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    try:
        rec = Recommender.from_checkpoint(opts.ckpt_path)
    except (ValueError, OSError) as err:
        print(f"error: --ckpt_path {err}".splitlines()[0], file=sys.stderr)
        return 2
    try:
        out = export(rec, opts.ckpt_path, opts.output, opts.overwrite)
    except ValueError as err:  # ExportError, an output over an input
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    name = f"{type(rec.model).__name__} (precision={rec.model.precision}, {rec.num_items} items)"
    files = "model.onnx, items.npy, item_bias.npy, vocabulary.json, export.json"
    print(f"export: {name} written to {out}/ ({files}); onnxruntime matches PyTorch",
          file=sys.stderr)  # fmt: skip
    return 0
