"""Kernel tests: import Triton in its interpreter mode before anything imports it."""

from __future__ import annotations

import os
import sys
from importlib.util import find_spec

import torch


def _import_triton_interpreted() -> None:
    """Import Triton in its interpreter mode now, when this folder is collected, on a machine
    without CUDA: the mode is fixed at Triton's first import (TRITON_INTERPRET),
    and ``torch._dynamo`` imports it, in compiled mode, when it is first imported. The
    variable is set back afterwards, so only these tests run the kernels on a CPU."""
    if "triton" in sys.modules or torch.cuda.is_available() or find_spec("triton") is None:
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


_import_triton_interpreted()
