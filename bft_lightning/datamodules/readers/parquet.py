"""Parquet interaction logs: one row per interaction, columns named like a CSV header."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import columnar
from ._common import MAX_ID_CHARS, check_exists
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
        table = pq.read_table(path, columns=wanted)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from None
    if table.num_rows == 0:
        raise ValueError(f"{path}: empty file (no interactions)")
    users = _ids(path, table[cols["user"]], str(cols["user"]))
    items = _ids(path, table[cols["item"]], str(cols["item"]))
    time = None if cols["time"] is None else _times(path, table[cols["time"]], str(cols["time"]))
    log = columnar.build(path, users, items, time, want_time=time is not None)
    assert log is not None
    return log


def _where(path: Path, mask: pa.ChunkedArray | pa.Array, column: str) -> str:
    """``<file>: row <r> (column <name>)`` for the first true entry of ``mask``."""
    row = pc.index(mask, True).as_py()
    return f"{path}: row {row + 1} (column {column!r})"


def _plain(col: pa.ChunkedArray) -> pa.ChunkedArray:
    if pa.types.is_dictionary(col.type):
        return col.cast(col.type.value_type)
    return col


def _ids(path: Path, col: pa.ChunkedArray, column: str) -> tuple[np.ndarray, np.ndarray]:
    col = _plain(col)
    if col.null_count:
        raise ValueError(f"{_where(path, pc.is_null(col), column)}: null id")
    if pa.types.is_integer(col.type):
        col = col.cast(pa.int64())
        negative = pc.less(col, 0)
        if pc.any(negative).as_py():
            value = col[pc.index(negative, True).as_py()].as_py()
            raise ValueError(f"{_where(path, negative, column)}: negative id {value}")
        codes, vocab = columnar._dictionary(col)
        return codes, vocab.to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        length = pc.utf8_length(pc.utf8_trim_whitespace(col))
        for bad, what in [
            (pc.equal(length, 0), "empty id"),
            (pc.greater(length, MAX_ID_CHARS), f"id longer than {MAX_ID_CHARS} characters"),
        ]:
            if pc.any(bad).as_py():
                raise ValueError(f"{_where(path, bad, column)}: {what}")
        coded = columnar.token_codes(col)
        assert coded is not None
        return coded
    raise ValueError(f"{path}: column {column!r} has type {col.type}; ids are integers or strings")


def _times(path: Path, col: pa.ChunkedArray, column: str) -> tuple[np.ndarray, np.ndarray]:
    col = _plain(col)
    if col.null_count:
        raise ValueError(f"{_where(path, pc.is_null(col), column)}: null timestamp")
    if pa.types.is_timestamp(col.type):
        ticks = col.cast(pa.int64()).to_numpy()
        return np.floor_divide(ticks, _UNIT[col.type.unit]), ticks
    if pa.types.is_integer(col.type):
        whole = col.cast(pa.int64()).to_numpy()
        return whole, whole
    if pa.types.is_floating(col.type):
        out = columnar.time_columns(col.cast(pa.float64()))
        if out is None:
            values = col.cast(pa.float64()).to_numpy()
            bad = pa.array(~np.isfinite(values) | (np.abs(values) >= 2.0**53))
            raise ValueError(f"{_where(path, bad, column)}: non-finite or out-of-range timestamp")
        return out
    raise ValueError(
        f"{path}: column {column!r} has type {col.type}; timestamps are numbers or timestamps"
    )
