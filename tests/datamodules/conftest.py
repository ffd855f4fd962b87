"""Shared fixtures for the datamodule tests: the real-data root and a file writer."""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def data_root() -> Path:
    """``$BFT_DATA_ROOT`` or ``<repo>/../shared/data``; skips when absent."""
    root = Path(os.environ.get("BFT_DATA_ROOT", REPO.parent / "shared" / "data"))
    if not root.is_dir():
        pytest.skip(f"real datasets not found at {root} (set BFT_DATA_ROOT)")
    return root


@pytest.fixture()
def write(tmp_path: Path) -> Callable[..., Path]:
    """``write(name, text, gz=False)`` creates a file under ``tmp_path``."""

    def _write(name: str, text: str, gz: bool = False) -> Path:
        path = tmp_path / name
        if gz:
            with gzip.open(path, "wt", encoding="utf-8") as fh:
                fh.write(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path

    return _write
