"""Integer-id formats: S3-Rec lines, SASRec pairs, LC-Rec JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa

from . import columnar
from ._common import (
    MAX_ID_CHARS,
    Builder,
    bad,
    check_exists,
    decode,
    first_line,
    int_id,
    is_digits,
    lines,
    nonempty,
    read_bytes,
)
from .log import InteractionLog

__all__ = ["read_json", "read_pairs", "read_s3rec"]

_TOO_LONG = 10**MAX_ID_CHARS


def read_s3rec(path: str | Path) -> InteractionLog:
    """Read the S3-Rec format: one line per user, ``user item1 item2 ...``.

    Items are in chronological order. A user id that appears on two lines is
    an error (the order between the lines would be undefined).
    """
    path = Path(path)
    builder = Builder()
    seen: dict[int, int] = {}
    for lineno, line in lines(path):
        fields = line.split()
        if len(fields) < 2:
            raise bad(path, lineno, "expected 'user item1 item2 ...', got only one field")
        user = int_id(fields[0], path, lineno, "user id")
        if user in seen:
            raise bad(path, lineno, f"user {user} already listed on line {seen[user]}")
        seen[user] = lineno
        for f in fields[1:]:
            builder.add(user, int_id(f, path, lineno, "item id"))
    return builder.build(path, sort_by_time=False)


def read_pairs(path: str | Path) -> InteractionLog:
    """Read SASRec ``user item`` pairs, one interaction per line, in time order."""
    path = Path(path)
    fast = _fast_pairs(path)
    if fast is not None:
        return fast
    builder = Builder()
    for lineno, line in lines(path):
        fields = line.split()
        if len(fields) != 2:
            raise bad(path, lineno, f"expected 2 fields 'user item', got {len(fields)}")
        user = int_id(fields[0], path, lineno, "user id")
        builder.add(user, int_id(fields[1], path, lineno, "item id"))
    return builder.build(path, sort_by_time=False)


def _fast_pairs(path: Path) -> InteractionLog | None:
    """Well-formed pairs through pyarrow (``None``: read line by line)."""
    first = first_line(path)
    if first is None:
        return None
    cols = columnar.read_delimited(
        path, "\t" if "\t" in first else " ", 2, {0: pa.string(), 1: pa.string()}
    )
    if cols is None:
        return None
    return columnar.code_columns(path, cols, "c0", "c1", None, integer_ids=True)


def _json_id(value: object, where: str) -> int:
    """Validate one JSON id (a non-negative int, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: non-integer item id {value!r}")
    if value < 0:
        raise ValueError(f"{where}: negative item id {value}; ids must be non-negative")
    if value >= _TOO_LONG:
        raise ValueError(f"{where}: item id of more than {MAX_ID_CHARS} digits")
    return value


def read_json(path: str | Path) -> InteractionLog:
    """Read a JSON object ``{"user": [item, ...]}`` (LC-Rec / MQL4GRec, 0-based ids).

    Lists are chronological. The file may be gzipped; it must be UTF-8. Errors
    name the file and, for broken JSON, the line and column; for bad values,
    the user key and list position.
    """
    path = Path(path)
    check_exists(path)
    text = decode(path, read_bytes(path))
    if not text.strip():
        raise ValueError(f"{path}: empty file (no interactions)")
    long_number = re.search(rf"\d{{{MAX_ID_CHARS + 1},}}", text)
    if long_number is not None:  # json's int() would fail bare beyond 4300 digits
        lineno = text.count("\n", 0, long_number.start()) + 1
        size = len(long_number.group())
        raise bad(path, lineno, f"a number of {size} digits (ids have at most {MAX_ID_CHARS})")
    try:  # pairs, not a dict: a repeated key must not silently replace the first
        obj = json.loads(text, object_pairs_hook=lambda pairs: pairs)
    except json.JSONDecodeError as err:
        raise bad(path, err.lineno, f"broken JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(obj, list) or (obj and not isinstance(obj[0], tuple)):
        raise ValueError(f"{path}: expected a JSON object {{user: [items]}}")
    builder = Builder()
    seen: dict[int, str] = {}
    for key, items in obj:
        where = f"{path}: user {key[:40]!r}"
        if not is_digits(key):
            raise ValueError(f"{where}: user key is not a non-negative integer")
        if len(key) > MAX_ID_CHARS:
            raise ValueError(f"{where}: user key of {len(key)} digits (at most {MAX_ID_CHARS})")
        if int(key) in seen:  # "3" twice, or "3" and "03"
            raise ValueError(f"{where}: user {int(key)} appears twice (also as {seen[int(key)]!r})")
        seen[int(key)] = key
        if not isinstance(items, list) or not items:
            raise ValueError(f"{where}: expected a non-empty list of item ids")
        for k, v in enumerate(items):
            builder.add(int(key), _json_id(v, f"{where}, position {k}"))
    return nonempty(builder.build(path, sort_by_time=False))
