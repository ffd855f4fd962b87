"""Incremental factorisation: a column coded block by block into one growing vocabulary.

The columnar readers parse a file in blocks (record batches) and code each
block's ids as soon as it is parsed, so the raw string columns of the whole
file never exist at once: what grows is one ``int32`` code per row and the
distinct ids themselves. A block's ids are dictionary-encoded (one hash pass
over its rows) and its distinct values looked up in the vocabulary so far
(``index_in``); values not seen before are appended in their order of first
appearance in the block, so the codes number ids by first appearance in the
file, exactly as one pass over the whole column would.

Every coder returns ``None`` for a block it refuses (a null, empty, signed or
overlong id, a non-finite timestamp, ...): the caller then falls back to the
line-exact reader, which names the file and line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ._common import MAX_ID_CHARS

__all__ = ["Times", "Vocabulary", "release_memory"]

EXACT = 2**53  # float64 holds every integer below this exactly
_MAX_CODES = 2**31 - 1  # codes are int32
MERGE_MIN = 1 << 20  # distinct values of waiting blocks that trigger a merge at the least


class Vocabulary:
    """The distinct ids of one column and its codes, numbered by first appearance over blocks.

    ``kind="int"``: ids must be ASCII-digit strings (or integers) and are kept
    as ``int64`` (S3-Rec pairs, MovieLens). ``kind="token"``: ids are stripped
    strings (RecBole tokens, Amazon ids); while every block holds only plain
    decimal tokens without a leading zero they are hashed as ``int64`` (the
    same identity as the strings, several times faster), and the vocabulary
    turns to strings for good at the first block that does not.

    Each block is dictionary-encoded on its own (local codes and its distinct
    values, in block order). The blocks' distinct values wait until they are
    as many as the vocabulary so far (or :data:`MERGE_MIN`); then one
    dictionary encoding of ``vocabulary + waiting values`` numbers the new ids
    after the known ones, in order of first appearance, and the waiting
    blocks' local codes are mapped to global ones. Every id is hashed a
    bounded number of times (a geometric schedule: ``O(rows)`` in all), and
    the memory held is that of the codes plus at most twice the vocabulary.
    """

    def __init__(self, kind: str, rows: int = 0) -> None:
        if kind not in ("int", "token"):
            raise ValueError(f"kind must be 'int' or 'token', got {kind!r}")
        self.kind = kind
        self.as_int = True  # token vocabularies start on the integer fast path
        self.values: pa.Array | None = None
        self.codes = Column(np.int32, rows)  # rows from ``_waiting_rows[0][0]`` on: local codes
        self._waiting: list[pa.Array] = []  # the waiting blocks' distinct values
        self._waiting_rows: list[tuple[int, int]] = []  # and their rows in ``codes``
        self._waiting_size = 0

    def __len__(self) -> int:
        return 0 if self.values is None else len(self.values)

    def add(self, col: pa.Array | pa.ChunkedArray) -> bool:
        """Code one block of ids (``False``: refused; the codes are then unusable)."""
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        if col.null_count:
            return False
        if len(col) == 0:
            return True
        if pa.types.is_integer(col.type):  # an integer column (Parquet)
            return self._add_integers(col.cast(pa.int64()))
        if self.kind == "int":
            return self._add_int_text(col)
        return self._add_tokens(col)

    def _add_integers(self, numbers: pa.Array) -> bool:
        if not self.as_int:
            return self._code(pc.cast(numbers, pa.string()))
        return self._code(numbers)

    def _add_int_text(self, col: pa.Array) -> bool:
        if not pc.all(pc.ascii_is_decimal(col)).as_py():
            return False  # empty, signed, spaced, non-ASCII digits, ...
        if pc.max(pc.binary_length(col)).as_py() > 18:
            return False  # may not fit int64: the exact reader keeps Python ints
        return self._code(pc.cast(col, pa.int64()))

    def _add_tokens(self, col: pa.Array) -> bool:
        decimal = pc.all(pc.ascii_is_decimal(col)).as_py()  # "" is not decimal
        if decimal and self.as_int and self._plain_integers(col):
            return True
        self._to_strings()
        if not decimal and not pc.all(pc.ascii_is_alnum(col)).as_py():
            col = pc.utf8_trim_whitespace(col)  # "" is not alphanumeric either
            if pc.min(pc.utf8_length(col)).as_py() == 0:
                return False
        if pc.max(pc.binary_length(col)).as_py() > MAX_ID_CHARS:  # bytes >= characters
            if pc.max(pc.utf8_length(col)).as_py() > MAX_ID_CHARS:
                return False
        return self._code(col)

    def _plain_integers(self, col: pa.Array) -> bool:
        """Code through ``int64``; ``False`` (nothing added) when a token has a
        leading zero (``07`` is not ``7`` for string ids) or overflows.

        The leading-zero check is free: the tokens' total length (from the
        string offsets) equals the digits of their values exactly when none is
        padded."""
        try:
            numbers = pc.cast(col, pa.int64())
        except pa.ArrowInvalid:
            return False
        encoded = pc.dictionary_encode(numbers)
        values = encoded.dictionary.to_numpy(zero_copy_only=False)
        indices = encoded.indices.to_numpy(zero_copy_only=False)
        digits = np.ones(len(values), dtype=np.int64)
        for k in range(1, 19):  # exact: 1 + the powers of ten not above the value
            digits += values >= 10**k
        if int(np.bincount(indices, minlength=len(values)) @ digits) != text_bytes(col):
            return False
        return self._wait(encoded.dictionary, indices)

    def _to_strings(self) -> None:
        if self.kind == "token" and self.as_int:
            self._merge()
            self.as_int = False
            if self.values is not None:
                self.values = pc.cast(self.values, pa.string())

    def _code(self, col: pa.Array) -> bool:
        encoded = pc.dictionary_encode(col)
        return self._wait(encoded.dictionary, encoded.indices.to_numpy(zero_copy_only=False))

    def _wait(self, local: pa.Array, indices: np.ndarray) -> bool:
        """Hold a block's local codes and distinct values until the next merge."""
        start = self.codes.size
        self.codes.append(indices)
        self._waiting_rows.append((start, self.codes.size))
        self._waiting.append(local)
        self._waiting_size += len(local)
        if self._waiting_size >= max(len(self), MERGE_MIN):
            self._merge()
        return len(self) <= _MAX_CODES

    def _merge(self) -> None:
        """Number the waiting blocks' new ids and turn their codes global."""
        if not self._waiting:
            return
        known = [] if self.values is None else [self.values]
        merged = pa.concat_arrays(known + self._waiting)
        encoded = pc.dictionary_encode(merged)
        del merged
        codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32)
        self.values = encoded.dictionary
        at = len(known[0]) if known else 0
        for local, (start, stop) in zip(self._waiting, self._waiting_rows):
            block = self.codes.buffer[start:stop]
            block[:] = codes[at : at + len(local)][block]
            at += len(local)
        self._waiting, self._waiting_rows, self._waiting_size = [], [], 0

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """``(int32 codes of every row, ids in code order)``; the block codes are released.

        The ids are ``int64`` (integer ids) or ``str`` values."""
        self._merge()
        codes = self.codes.array()
        if self.values is None:
            return codes, np.zeros(0, dtype=np.int64 if self.kind == "int" else object)
        values = self.values.to_numpy(zero_copy_only=False)
        self.values = None
        if self.kind == "int":
            return codes, values.astype(np.int64)
        if self.as_int:  # plain-integer tokens: their strings (no leading zeros)
            return codes, values.astype(str)
        return codes, values


def text_bytes(col: pa.Array) -> int:
    """Bytes of a string array's values (from its offsets; no pass over the data)."""
    width = 8 if pa.types.is_large_string(col.type) else 4
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int32 if width == 4 else np.int64)
    first = col.offset
    return int(offsets[first + len(col)] - offsets[first])


class Times:
    """Unix timestamps of a column, block by block: whole seconds and the exact order key.

    Integer-valued times keep one ``int64`` per row (the key is the same
    array); once a block has a fractional time, the exact ``float64`` values
    are kept too (earlier blocks' whole seconds are exact as floats), so
    100.9 sorts after 100.1 although both store 100."""

    def __init__(self, rows: int = 0) -> None:
        self.whole = Column(np.int64, rows)
        self.exact: Column | None = None

    def add(self, col: pa.Array) -> bool:
        """Add one block (``False``: refused: a null, non-finite or ``|t| >= 2**53``)."""
        if col.null_count:
            return False
        values = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
        if len(values) and not (np.isfinite(values).all() and np.abs(values).max() < EXACT):
            return False
        whole = np.trunc(values).astype(np.int64)
        fractional = not np.array_equal(whole, values)
        if fractional and self.exact is None:
            self.exact = Column(np.float64, len(self.whole.buffer))
            self.exact.append(self.whole.buffer[: self.whole.size])
        self.whole.append(whole)
        if self.exact is not None:
            self.exact.append(values)
        return True

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """``(whole seconds, order key)``, the chunks released."""
        whole = self.whole.array()
        if self.exact is None:
            return whole, whole
        return whole, self.exact.array()


def _libc_trim() -> Callable[[], object]:
    """``malloc_trim(0)`` of glibc, or a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


_trim = _libc_trim()


def release_memory() -> None:
    """Give freed memory back to the system: Arrow's pool and the C heap.

    Blocks are parsed, coded and freed in turn; without this, the allocators
    keep their pages (glibc raises its mmap threshold after the first large
    free, so later blocks come from the heap, which it does not shrink), and
    the process's resident memory grows as if every block were still held."""
    pa.default_memory_pool().release_unused()
    _trim()


class Column:
    """A 1-D array appended to block by block, its storage reserved ahead.

    ``rows`` (an estimate of the final length; it may be short) sizes the
    buffer up front: ``np.empty`` pages cost no memory until they are written,
    so a generous estimate is free, and the rows are never copied into a
    final array. Past the estimate the buffer doubles (one copy)."""

    def __init__(self, dtype: type, rows: int = 0) -> None:
        self.buffer: np.ndarray = np.empty(max(int(rows), 1 << 16), dtype=dtype)
        self.size = 0

    def append(self, values: np.ndarray) -> None:
        end = self.size + len(values)
        if end > len(self.buffer):
            grown = np.empty(max(2 * len(self.buffer), end), dtype=self.buffer.dtype)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        self.buffer[self.size : end] = values
        self.size = end

    def array(self) -> np.ndarray:
        """The rows appended (a view of the buffer, whose unused tail is never touched)."""
        return self.buffer[: self.size]
