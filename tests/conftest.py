"""Shared test set-up: small thread counts, deterministic seeds, the data root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parents[1]
DATA_ROOT = Path(os.environ.get("BFT_DATA_ROOT", REPO.parent / "shared" / "data"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def data_root() -> Path:
    """The shared real datasets; tests that need them skip when they are absent."""
    if not DATA_ROOT.is_dir():
        pytest.skip(f"real datasets not found at {DATA_ROOT} (set BFT_DATA_ROOT)")
    return DATA_ROOT
