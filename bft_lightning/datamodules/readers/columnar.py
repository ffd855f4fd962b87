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

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from ._common import is_gzip
from .coding import Times, Vocabulary, release_memory
from .log import InteractionLog, from_parts

__all__ = ["code_columns", "read_delimited", "token_codes"]

BLOCK_BYTES = 1 << 24  # text parsed at a time: the raw columns of one block at a time
_BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")


class _Refused(ValueError):
    """The file is not for the fast path (the exact reader explains why)."""


def _blocks(path: Path) -> Iterator[bytes]:
    """The file's text (un-gzipped) in blocks of whole lines of about :data:`BLOCK_BYTES`.

    Raises :class:`_Refused` when the file starts with a byte-order mark or its
    last non-blank line has no line end. Blank blocks are skipped."""
    with open(path, "rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    try:
        stream = pa.input_stream(str(path), compression="gzip" if gz else None)
    except (OSError, pa.ArrowException) as err:
        raise _Refused(str(err)) from None
    with stream:
        rest, first = b"", True
        while True:
            block = stream.read(BLOCK_BYTES)
            if first and (rest + block).startswith(_BOMS):
                raise _Refused("byte-order mark")
            first = False
            if not block:
                break
            cut = block.rfind(b"\n")
            if cut < 0:
                rest += block
                continue
            text, rest = rest + block[: cut + 1], block[cut + 1 :]
            if not text.isspace():
                yield text
    if rest and not rest.isspace():
        raise _Refused("the last line has no line end")


def read_delimited(
    path: Path,
    delimiter: str,
    ncols: int,
    types: dict[int, pa.DataType],
    skip_rows: int = 0,
    quoting: bool = False,
) -> Iterator[tuple[pa.Table, int]]:
    """Blocks of columns ``c<k>`` (only those in ``types``) of a delimited file.

    Each block comes with an estimate of the file's rows (from the first
    block's share of the file; ``0`` when unknown, as for gzip).

    The file is read and parsed one block of lines at a time (:data:`BLOCK_BYTES`
    of text), so the raw columns of the whole file never exist at once, and a
    gzipped file is never held un-gzipped. Every row must have exactly
    ``ncols`` fields. Strings are never null; the only null value is the empty
    field (for ``pa.null()`` and float columns). A parse error, a byte-order
    mark or a missing final line end raises ``ValueError`` while iterating.
    """
    names = [f"c{k}" for k in range(ncols)]
    parse = pacsv.ParseOptions(
        delimiter=delimiter,
        quote_char='"' if quoting else False,
        double_quote=quoting,
        escape_char=False,
        newlines_in_values=False,
        ignore_empty_lines=True,
    )
    convert = pacsv.ConvertOptions(
        column_types={names[k]: t for k, t in types.items()},
        include_columns=[names[k] for k in sorted(types)],
        null_values=[""],
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )
    size, gz = path.stat().st_size, is_gzip(path)
    for k, text in enumerate(_blocks(path)):
        options = pacsv.ReadOptions(
            column_names=names, skip_rows=skip_rows if k == 0 else 0, use_threads=False
        )
        table = pacsv.read_csv(
            pa.py_buffer(text),
            read_options=options,
            parse_options=parse,
            convert_options=convert,
        )
        # the file's rows, estimated from its first block (sizes the code buffers)
        yield table, (0 if gz or k else int(table.num_rows * 1.1 * size / len(text)) + 1)


def code_columns(
    path: Path,
    batches: Iterable[tuple[pa.Table, int]],
    user: str,
    item: str,
    time: str | None,
    integer_ids: bool,
) -> InteractionLog | None:
    """The log from a file's blocks (``None``: refused), each block coded as it is parsed.

    What is held across blocks is one ``int32`` code per row for users and
    items, the timestamps and the distinct ids; a block's raw columns go as
    soon as it is coded."""
    kind = "int" if integer_ids else "token"
    users = items = Vocabulary(kind)
    stamps = None
    try:
        for k, (batch, rows) in enumerate(batches):
            if k == 0:
                users, items = Vocabulary(kind, rows), Vocabulary(kind, rows)
                stamps = None if time is None else Times(rows)
            if stamps is not None and not stamps.add(batch.column(time)):
                return None
            if not (users.add(batch.column(user)) and items.add(batch.column(item))):
                return None
            del batch
            release_memory()
    except (pa.ArrowException, OSError, ValueError):
        return None  # a parse error in a later block: the exact reader names the line
    finally:
        release_memory()
    return assemble(path, users, items, stamps)


def assemble(
    path: Path, users: Vocabulary, items: Vocabulary, stamps: Times | None
) -> InteractionLog | None:
    """The log from coded blocks (released as they are joined), or ``None`` when it is empty."""
    ucodes, user_vocab = users.finish()
    parts: dict[str, np.ndarray] = {"user": ucodes}
    del ucodes
    if len(parts["user"]) == 0:
        return None  # the exact reader says "empty file"
    parts["item"], item_vocab = items.finish()
    if stamps is not None:
        parts["time"], parts["key"] = stamps.finish()
    release_memory()
    return build(path, parts, user_vocab, item_vocab)


def build(
    path: Path, parts: dict[str, np.ndarray], user_vocab: np.ndarray, item_vocab: np.ndarray
) -> InteractionLog:
    """The log from coded rows in file order (``parts`` is emptied: see :func:`.log.from_parts`)."""
    return from_parts(parts, user_vocab, item_vocab, str(path))


def token_codes(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """Codes and vocabulary (of ``str``) of stripped string tokens, or ``None`` (empty/long)."""
    vocab = Vocabulary("token")
    if not all(vocab.add(chunk) for chunk in col.chunks):
        return None
    codes, values = vocab.finish()
    return codes.astype(np.int64), values
