"""reproduce_rec's tables rerun with the SASRec recipe they were trained with, whatever
the shipped configs say now; `--recipe shipped` and tune_twins train the configs as shipped."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import reproduce_rec as rr  # noqa: E402


class _Composed(Exception):
    pass


def _argv(tmp_path: Path, monkeypatch, variant: str, **extra) -> list[str]:  # noqa: ANN001, ANN003
    seen = {}

    def compose(argv, run=False):  # noqa: ANN001, ANN202
        seen["argv"] = argv
        raise _Composed

    monkeypatch.setattr(rr, "cli_main", compose)
    args = argparse.Namespace(
        results_dir=str(tmp_path / "results"), max_epochs=3, loss_normalization="rows",
        accelerator=None, backbone="sasrec", dataset="synthetic", data_root=str(tmp_path),
        override=["--model.init_args.backbone.init_args.dropout=0.5"], **extra,
    )  # fmt: skip
    out = tmp_path / "runs" / "t" / f"{variant}_s0"
    out.mkdir(parents=True)
    with pytest.raises(_Composed):
        rr.run_one(args, variant, 0, out)
    return seen["argv"]


def _last(argv: list[str], key: str) -> str | None:
    """The value the CLI takes for ``key``: the last one given."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{key}=")]
    return values[-1] if values else None


def test_the_tables_recipe_is_pinned_beneath_the_variant_and_the_overrides(
    tmp_path, monkeypatch
) -> None:
    argv = _argv(tmp_path, monkeypatch, "on_constant", recipe="tables")
    assert _last(argv, "model.init_args.loss") == "ce"
    assert _last(argv, "model.init_args.negatives") == "popularity"
    assert _last(argv, "model.init_args.prior_lr_scale") == "1"  # the variant's own pin wins
    assert _last(argv, "model.init_args.backbone.init_args.dropout") == "0.5"  # --override wins
    off = _argv(tmp_path / "b", monkeypatch, "off", recipe="tables")
    assert _last(off, "model.init_args.prior_lr_scale") is None  # the off twin has no tau


@pytest.mark.parametrize("extra", [{"recipe": "shipped"}, {}], ids=["shipped", "tune_twins"])
def test_the_shipped_recipe_adds_nothing(tmp_path, monkeypatch, extra) -> None:  # noqa: ANN001
    argv = _argv(tmp_path, monkeypatch, "off", **extra)
    assert _last(argv, "model.init_args.loss") is None
    assert _last(argv, "model.init_args.negatives") is None


def test_shipped_runs_are_told_apart_from_table_runs() -> None:
    base = dict(max_epochs=3, override=[], loss_normalization="rows", accelerator=None)
    tables = rr._settings(argparse.Namespace(recipe="tables", **base))
    shipped = rr._settings(argparse.Namespace(recipe="shipped", **base))
    assert tables != shipped
    assert tables == rr._settings(argparse.Namespace(**base))  # as the archives recorded it
