"""Fast columnar paths: pyarrow parses, numpy factorises and sorts.

Each ``read_*`` here returns an :class:`InteractionLog` for a well-formed file,
or ``None`` as soon as anything is unusual (a parse error, a wrong field
count, an empty, negative, non-ASCII-digit or overlong id, a non-finite or
fractional-beyond-float timestamp, a byte-order mark, a missing final line
end, ...). The caller then re-reads the file with its line-exact reader,
which names the file and line of the first bad row, or reads a valid but
unusual file exactly as before. The fast path therefore accepts a subset of
what the exact path accepts, and gives the same log for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from ._common import MAX_ID_CHARS
from .log import InteractionLog, from_rows

__all__ = ["id_codes", "read_delimited", "token_codes"]

_EXACT = 2**53  # float64 holds every integer below this exactly
_TAIL = 1 << 16


def _source(path: Path) -> Any:
    """What pyarrow should read (a path, or the un-gzipped buffer), or ``None``.

    ``None`` when the file starts with a byte-order mark or its last non-blank
    line has no line end (the exact reader explains both)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head[:2] == b"\x1f\x8b":
        try:
            with pa.input_stream(str(path), compression="gzip") as stream:
                buf = stream.read_buffer()
        except (OSError, pa.ArrowException):
            return None
        data = memoryview(buf)
        if not _ends_well(bytes(data[:4]), bytes(data[-_TAIL:])):
            return None
        return pa.BufferReader(buf)
    with open(path, "rb") as fh:
        fh.seek(max(0, path.stat().st_size - _TAIL))
        tail = fh.read()
    return str(path) if _ends_well(head, tail) else None


def _ends_well(head: bytes, tail: bytes) -> bool:
    if head.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        return False
    body = tail.rstrip(b" \t\r\n\x0b\x0c")
    if not body:
        return False  # all blank at the end: let the exact reader decide
    return b"\n" in tail[len(body) :]


def read_delimited(
    path: Path,
    delimiter: str,
    ncols: int,
    types: dict[int, pa.DataType],
    skip_rows: int = 0,
    quoting: bool = False,
) -> dict[str, pa.ChunkedArray] | None:
    """Columns ``c<k>`` (only those in ``types``) of a delimited file, or ``None``.

    Every row must have exactly ``ncols`` fields. Strings are never null; the
    only null value is the empty field (for ``pa.null()`` and float columns).
    """
    source = _source(path)
    if source is None:
        return None
    names = [f"c{k}" for k in range(ncols)]
    try:
        table = pacsv.read_csv(
            source,
            read_options=pacsv.ReadOptions(column_names=names, skip_rows=skip_rows),
            parse_options=pacsv.ParseOptions(
                delimiter=delimiter,
                quote_char='"' if quoting else False,
                double_quote=quoting,
                escape_char=False,
                newlines_in_values=False,
                ignore_empty_lines=True,
            ),
            convert_options=pacsv.ConvertOptions(
                column_types={names[k]: t for k, t in types.items()},
                include_columns=[names[k] for k in sorted(types)],
                null_values=[""],
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
            ),
        )
    except (pa.ArrowException, OSError, ValueError):
        return None
    return {name: table.column(name) for name in table.column_names}


def code_columns(
    path: Path,
    cols: dict[str, pa.ChunkedArray],
    user: str,
    item: str,
    time: str | None,
    integer_ids: bool,
) -> InteractionLog | None:
    """The log from the columns read (``None``: refused), freeing each column once coded.

    ``cols`` is emptied: a column's memory goes back as soon as it is coded, so
    the peak holds one raw column next to the coded ones."""
    code = id_codes if integer_ids else token_codes
    stamps = None if time is None else time_columns(cols.pop(time))
    users = code(cols.pop(user)) if time is None or stamps is not None else None
    items = code(cols.pop(item)) if users is not None else None
    cols.clear()
    log = build(path, users, items, stamps, want_time=time is not None)
    pa.default_memory_pool().release_unused()
    return log


def _dictionary(col: pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """``(codes, dictionary)`` numbered by first appearance."""
    encoded = pc.dictionary_encode(col)
    chunks = encoded.chunks
    if not chunks:
        return np.zeros(0, dtype=np.int64), pa.array([], type=col.type)
    vocab = chunks[-1].dictionary  # one memo table over the chunks: each is a prefix
    codes = np.concatenate([c.indices.to_numpy(zero_copy_only=False) for c in chunks])
    return codes.astype(np.int64, copy=False), vocab


def id_codes(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """Codes and ``int64`` vocabulary of a string column of ASCII-digit ids, or ``None``."""
    if col.null_count or not pc.all(pc.ascii_is_decimal(col)).as_py():
        return None  # empty, signed, spaced, non-ASCII digits, ...
    if len(col) and pc.max(pc.binary_length(col)).as_py() > 18:
        return None  # may not fit int64: the exact reader keeps Python ints
    codes, vocab = _dictionary(pc.cast(col, pa.int64()))
    return codes, vocab.to_numpy(zero_copy_only=False).astype(np.int64)


def token_codes(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """Codes and vocabulary (of ``str``) of stripped string tokens, or ``None`` (empty/long).

    Tokens of ASCII digits without a leading zero are factorised as integers
    (the same identity as the strings, and several times faster to hash);
    other all-alphanumeric columns (the usual case) need no stripping."""
    if col.null_count:
        return None
    if len(col) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=object)
    if pc.all(pc.ascii_is_decimal(col)).as_py():  # "" is not decimal
        coded = _plain_integer_codes(col)
        if coded is not None:
            return coded
    elif not pc.all(pc.ascii_is_alnum(col)).as_py():  # "" is not alphanumeric either
        col = pc.utf8_trim_whitespace(col)
        if pc.min(pc.utf8_length(col)).as_py() == 0:
            return None
    if pc.max(pc.binary_length(col)).as_py() > MAX_ID_CHARS:  # bytes >= characters
        if pc.max(pc.utf8_length(col)).as_py() > MAX_ID_CHARS:
            return None
    codes, vocab = _dictionary(col)
    return codes, vocab.to_numpy(zero_copy_only=False)


def _plain_integer_codes(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """Codes of a column of ASCII-digit tokens through int64, or ``None`` when a
    token has a leading zero (``07`` is not ``7`` for string ids) or overflows.

    The leading-zero check is free: the tokens' total length (from the string
    offsets) equals the digits of their values exactly when none is padded."""
    try:
        numbers = pc.cast(col, pa.int64())
    except pa.ArrowInvalid:
        return None
    codes, vocab = _dictionary(numbers)
    values = vocab.to_numpy(zero_copy_only=False)
    digits = np.ones(len(values), dtype=np.int64)
    for k in range(1, 19):  # exact: 1 + the powers of ten not above the value
        digits += values >= 10**k
    written = sum(_text_bytes(chunk) for chunk in col.chunks)
    if int(np.bincount(codes, minlength=len(values)) @ digits) != written:
        return None
    return codes, values.astype(str)


def _text_bytes(chunk: pa.Array) -> int:
    """Bytes of a string chunk's values (from its offsets; no pass over the data)."""
    width = 8 if pa.types.is_large_string(chunk.type) else 4
    offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32 if width == 4 else np.int64)
    first = chunk.offset
    return int(offsets[first + len(chunk)] - offsets[first])


def time_columns(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(whole seconds, order key)`` of a float column, or ``None``.

    ``None`` for nulls (empty fields), non-finite values or ``|t| >= 2**53``
    (where float64 is no longer exact; the exact reader keeps such integers)."""
    if col.null_count:
        return None
    values = col.to_numpy()
    if len(values) and not (np.isfinite(values).all() and np.abs(values).max() < _EXACT):
        return None
    whole = np.trunc(values).astype(np.int64)
    if np.array_equal(whole, values):
        return whole, whole
    return whole, values  # fractional: order by the exact value, store the whole seconds


def build(
    path: Path,
    users: tuple[np.ndarray, np.ndarray] | None,
    items: tuple[np.ndarray, np.ndarray] | None,
    time: tuple[np.ndarray, np.ndarray] | None = None,
    want_time: bool = False,
) -> InteractionLog | None:
    """The log from coded columns, or ``None`` when a column was refused or it is empty."""
    if users is None or items is None or (want_time and time is None):
        return None
    if len(users[0]) == 0:
        return None  # the exact reader says "empty file"
    whole, key = (None, None) if time is None else time
    return from_rows(users[0], users[1], items[0], items[1], whole, key, str(path))
