"""Recommendation rows ``(user, rank, item, score, confidence)`` written atomically.

Rows go to a ``.tmp-*`` file next to the output, which is renamed over it
(``os.replace``) only when everything is written: an interrupted or failed run
leaves no half-written output, and a previous output stays as it was.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO

__all__ = ["COLUMNS", "RowWriter", "output_format"]

COLUMNS = ("user", "rank", "item", "score", "confidence")
_SUFFIXES = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}


def output_format(path: str | Path, given: str | None = None) -> str:
    """``"csv"`` or ``"jsonl"``: ``given``, else from the file's suffix."""
    if given is not None:
        if given not in ("csv", "jsonl"):
            raise ValueError(f"output format must be 'csv' or 'jsonl', got {given!r}")
        return given
    fmt = _SUFFIXES.get(Path(path).suffix.lower())
    if fmt is None:
        raise ValueError(
            f"{path}: cannot tell the output format from the suffix; name it .csv or .jsonl "
            "(or pass the format)"
        )
    return fmt


class RowWriter:
    """Writes rows to a temporary file; :meth:`commit` renames it to ``path``."""

    def __init__(self, path: str | Path, fmt: str | None = None) -> None:
        self.path, self.format = Path(path), output_format(path, fmt)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=f".tmp-{self.path.name}-", dir=self.path.parent)
        self._fh: IO[str] | None = os.fdopen(fd, "w", newline="", encoding="utf-8")
        self._csv = csv.writer(self._fh) if self.format == "csv" else None
        if self._csv is not None:
            self._csv.writerow(COLUMNS)
        self.rows = 0

    def write(
        self, user: str, items: Sequence[str], scores: Sequence[float], confidence: float
    ) -> None:
        """One row per (rank, item) of one user, rank 1 = best."""
        assert self._fh is not None, "writer already closed"
        for rank, (item, score) in enumerate(zip(items, scores), start=1):
            if self._csv is not None:
                self._csv.writerow((user, rank, item, float(score), float(confidence)))
            else:
                row = dict(zip(COLUMNS, (user, rank, item, float(score), float(confidence))))
                self._fh.write(json.dumps(row) + "\n")
            self.rows += 1

    def commit(self) -> Path:
        """Flush, fsync and rename the temporary file to ``path``."""
        assert self._fh is not None, "writer already closed"
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        os.chmod(self._tmp, 0o644)
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the temporary file (the output is left as it was)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        Path(self._tmp).unlink(missing_ok=True)
