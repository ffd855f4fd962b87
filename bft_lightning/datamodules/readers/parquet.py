"""Parquet interaction logs: one row per interaction, columns named like a CSV header."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import columnar
from ._common import MAX_ID_CHARS, check_exists
from .coding import EXACT, Column, Times, Vocabulary
from .log import InteractionLog
from .reviews import CSV_NAMES

__all__ = ["read_parquet"]

_UNIT = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}


def read_parquet(path: str | Path) -> InteractionLog:
    """Read a Parquet file with user, item and (optionally) timestamp columns.

    Columns are found by name, case-insensitively, as in a CSV header
    (``user`` / ``user_id`` / ``reviewerID``, ``item`` / ``item_id`` / ``asin`` /
    ``parent_asin``, ``timestamp`` / ``time`` / ``unixReviewTime``). Ids are
    integer (non-negative; kept as ``int``) or string (stripped; kept as
    ``str``) columns; timestamps are integer or float unix seconds or a
    Parquet timestamp (stored as whole seconds, ordered exactly). Each user is
    sorted stably by time when there is a time column, else kept in row order.
    A null, empty, negative or overlong value raises naming the file, the row
    (1-based) and the column.
    """
    path = Path(path)
    check_exists(path)
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from None
    low = [n.lower() for n in names]
    cols = {
        key: next((names[low.index(n)] for n in options if n in low), None)
        for key, options in CSV_NAMES.items()
    }
    for key in ("user", "item"):
        if cols[key] is None:
            raise ValueError(
                f"{path}: no {key} column (columns {names}); name it one of {list(CSV_NAMES[key])}"
            )
    wanted = [c for c in cols.values() if c is not None]
    try:
        parquet = pq.ParquetFile(path)
        if parquet.metadata.num_rows == 0:
            raise ValueError(f"{path}: empty file (no interactions)")
        batches = parquet.iter_batches(batch_size=_BATCH_ROWS, columns=wanted)
        return _read_batches(path, batches, cols)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from None
    finally:
        pa.default_memory_pool().release_unused()


_BATCH_ROWS = 1 << 20  # rows read and coded at a time


def _read_batches(
    path: Path, batches: Iterator[pa.RecordBatch], cols: dict[str, str | None]
) -> InteractionLog:
    """Code the file batch by batch (its raw columns never all in memory at once)."""
    users, items = _Ids(path, str(cols["user"])), _Ids(path, str(cols["item"]))
    times = None if cols["time"] is None else _Stamps(path, cols["time"])
    row = 0
    for batch in batches:
        users.add(batch.column(str(cols["user"])), row)
        items.add(batch.column(str(cols["item"])), row)
        if times is not None:
            times.add(batch.column(str(cols["time"])), row)
        row += batch.num_rows
        del batch
    parts: dict[str, np.ndarray] = {}
    parts["user"], user_vocab = users.finish()
    parts["item"], item_vocab = items.finish()
    if times is not None:
        parts["time"], parts["key"] = times.finish()
    del users, items, times
    return columnar.build(path, parts, user_vocab, item_vocab)


def _where(path: Path, mask: pa.Array, column: str, row: int) -> str:
    """``<file>: row <r> (column <name>)`` for the first true entry of ``mask``."""
    first = pc.index(mask, True).as_py()
    return f"{path}: row {row + first + 1} (column {column!r})"


def _plain(col: pa.Array) -> pa.Array:
    if pa.types.is_dictionary(col.type):
        return col.cast(col.type.value_type)
    return col


class _Ids:
    """One id column, checked and coded batch by batch (errors name the row)."""

    def __init__(self, path: Path, column: str) -> None:
        self.path, self.column = path, column
        self.vocab: Vocabulary | None = None

    def add(self, col: pa.Array, row: int) -> None:
        path, column = self.path, self.column
        col = _plain(col)
        if col.null_count:
            raise ValueError(f"{_where(path, pc.is_null(col), column, row)}: null id")
        if pa.types.is_integer(col.type):
            col = col.cast(pa.int64())
            negative = pc.less(col, 0)
            if pc.any(negative).as_py():
                value = col[pc.index(negative, True).as_py()].as_py()
                raise ValueError(f"{_where(path, negative, column, row)}: negative id {value}")
            kind = "int"
        elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            length = pc.utf8_length(pc.utf8_trim_whitespace(col))
            for bad, what in [
                (pc.equal(length, 0), "empty id"),
                (pc.greater(length, MAX_ID_CHARS), f"id longer than {MAX_ID_CHARS} characters"),
            ]:
                if pc.any(bad).as_py():
                    raise ValueError(f"{_where(path, bad, column, row)}: {what}")
            kind = "token"
        else:
            raise ValueError(
                f"{path}: column {column!r} has type {col.type}; ids are integers or strings"
            )
        if self.vocab is None:
            self.vocab = Vocabulary(kind)
        if not self.vocab.add(col):  # only past 2**31 distinct ids: every value was checked
            raise ValueError(f"{path}: column {column!r} has too many distinct ids")

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        assert self.vocab is not None
        return self.vocab.finish()


class _Stamps:
    """The time column, checked batch by batch: whole seconds and the exact order key."""

    def __init__(self, path: Path, column: str) -> None:
        self.path, self.column = path, column
        self.whole = Column(np.int64)
        self.key: Column | None = None
        self.floats = Times()

    def add(self, col: pa.Array, row: int) -> None:
        path, column = self.path, self.column
        col = _plain(col)
        if col.null_count:
            raise ValueError(f"{_where(path, pc.is_null(col), column, row)}: null timestamp")
        if pa.types.is_timestamp(col.type):
            ticks = col.cast(pa.int64()).to_numpy()
            self.whole.append(np.floor_divide(ticks, _UNIT[col.type.unit]))
            if self.key is None:
                self.key = Column(np.int64)
            self.key.append(ticks)
        elif pa.types.is_integer(col.type):
            self.whole.append(col.cast(pa.int64()).to_numpy())
        elif pa.types.is_floating(col.type):
            values = col.cast(pa.float64())
            if not self.floats.add(values):
                numbers = values.to_numpy()
                bad = pa.array(~np.isfinite(numbers) | (np.abs(numbers) >= EXACT))
                raise ValueError(
                    f"{_where(path, bad, column, row)}: non-finite or out-of-range timestamp"
                )
        else:
            raise ValueError(
                f"{path}: column {column!r} has type {col.type}; timestamps are numbers or "
                "timestamps"
            )

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        if self.floats.whole.size:
            return self.floats.finish()
        whole = self.whole.array()
        return whole, (whole if self.key is None else self.key.array())
