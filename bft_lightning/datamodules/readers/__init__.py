"""Readers for sequential-recommendation interaction files.

Every reader returns an :class:`InteractionLog`: the raw user ids in order of
first appearance and, per user, the chronological raw item ids (and, where the
file has them, parallel unix timestamps), held as flat numpy arrays.

Well-formed delimited files (pairs, MovieLens, RecBole atomic files, review
CSVs) and Parquet files are parsed by pyarrow and grouped, sorted and
filtered in numpy (:mod:`.columnar`); anything the fast path does not accept
is re-read line by line, so the rules below hold either way.

Rules shared by all readers:

- A bad line raises ``ValueError`` whose message starts with ``<file>:<line>:``
  and says what is wrong (wrong field count, non-integer id, negative id,
  non-numeric, non-finite or out-of-range timestamp, broken JSON, missing
  key, an id longer than 256 characters). A missing file raises
  ``FileNotFoundError``; a file with no interactions raises ``ValueError``. No
  row is ever dropped silently; blank lines are not rows and are skipped. A
  text file whose last non-blank line has no line end is refused as
  truncated; UTF-16 / UTF-32 files are refused with their encoding named.
  Parquet errors name the file, the row and the column.
- Duplicates are kept as they are (Yelp users review a business again).
- Formats with timestamps (RecBole with a ``timestamp`` field, MovieLens,
  Amazon reviews, Parquet with a time column) are sorted per user by
  timestamp; the sort is stable, so ties keep file order, and fractional
  timestamps order by their exact value (``n log n``).
- Integer-id formats (S3-Rec, pairs, JSON, MovieLens) give ``int`` ids and
  reject negative ones; RecBole tokens and Amazon ids are strings.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ._common import check_exists, lines
from .integer import read_json, read_pairs, read_s3rec
from .log import InteractionLog, RawId, kcore_filter
from .parquet import read_parquet
from .recbole import read_recbole, read_recbole_sequential
from .reviews import read_amazon, read_movielens

__all__ = [
    "FORMATS",
    "InteractionLog",
    "RawId",
    "kcore_filter",
    "read_amazon",
    "read_interactions",
    "read_json",
    "read_movielens",
    "read_pairs",
    "read_parquet",
    "read_recbole",
    "read_recbole_sequential",
    "read_s3rec",
    "sniff_format",
]

FORMATS: dict[str, Callable[..., InteractionLog]] = {
    "s3rec": read_s3rec,
    "pairs": read_pairs,
    "json": read_json,
    "recbole": read_recbole,
    "movielens": read_movielens,
    "amazon": read_amazon,
    "parquet": read_parquet,
}


def sniff_format(path: str | Path) -> str:
    """Guess the format of ``path`` from its name and first lines."""
    path = Path(path)
    check_exists(path)
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".inter"):
        return "recbole"
    if name in ("ratings.dat", "u.data"):
        return "movielens"
    if name.endswith(".csv"):
        return "amazon"
    with open(path, "rb") as fh:
        if name.endswith((".parquet", ".pq")) or fh.read(4) == b"PAR1":
            return "parquet"
    head: list[str] = []
    rows = lines(path, check_end=False)
    try:
        for _, line in rows:
            head.append(line)
            if len(head) >= 50:
                break
    finally:
        rows.close()
    if not head:
        raise ValueError(f"{path}: empty file (no interactions)")
    return _sniff_lines(path, head)


def _sniff_lines(path: Path, head: list[str]) -> str:
    """Guess a format from the first non-blank lines."""
    if ":token" in head[0] or ":float" in head[0]:
        return "recbole"
    if head[0].startswith("{"):
        return "amazon" if '"reviewerID"' in head[0] else "json"
    if "::" in head[0]:
        return "movielens"
    widths = {len(line.split()) for line in head}
    if widths == {2}:
        return "pairs"
    if "\t" in head[0] and widths == {4}:
        return "movielens"
    if "," in head[0]:
        return "amazon"
    if min(widths) >= 2:
        return "s3rec"
    raise ValueError(f"{path}: cannot detect the format; pass format= explicitly")


def read_interactions(
    path: str | Path, format: str | None = None, kcore: int | None = None
) -> InteractionLog:
    """Read ``path`` with the reader for ``format`` (sniffed when ``None``).

    ``kcore=None`` uses the format's own default (5 for raw Amazon reviews,
    none otherwise); an integer applies iterative k-core to any format
    (0 or 1 = off).
    """
    fmt = format or sniff_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} for {path}; known: {sorted(FORMATS)}")
    if fmt == "amazon":
        return read_amazon(path, 5 if kcore is None else kcore)
    return kcore_filter(FORMATS[fmt](path), kcore or 0)
