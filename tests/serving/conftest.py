from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from recdata import train  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(checkpoint, data file, config) of SASRec fit on the cyclic data (seconds)."""
    return train(tmp_path_factory.mktemp("cyclic"))
