"""The check every written file passes: it never replaces a file it was made from.

One function, so that a project-wide output-path guard can take its place.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["check_output_path"]


def check_output_path(output: str | Path, inputs: Iterable[str | Path]) -> Path:
    """``output`` as a path; ``ValueError`` naming it when it is (or resolves to) one of
    ``inputs``."""
    out = Path(output).resolve()
    for item in inputs:
        if Path(item).resolve() == out:
            raise ValueError(f"{output}: the output would overwrite an input ({item})")
    return Path(output)
