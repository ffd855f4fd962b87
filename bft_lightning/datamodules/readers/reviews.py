"""Rating logs with timestamps: MovieLens and Amazon reviews (JSON lines or CSV)."""

from __future__ import annotations

import csv
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from . import columnar
from ._common import Builder, bad, first_line, int_id, lines, parse_time, token
from .log import InteractionLog, kcore_filter

__all__ = ["CSV_NAMES", "read_amazon", "read_movielens"]


def read_movielens(path: str | Path) -> InteractionLog:
    """Read MovieLens ``ratings.dat`` (``u::i::r::ts``) or ``u.data`` (tab separated).

    Each user is sorted stably by timestamp. All ratings are kept (implicit
    feedback). The separator is ``::`` when the first line contains it.
    """
    path = Path(path)
    fast = _fast_movielens(path)
    if fast is not None:
        return fast
    builder = Builder()
    sep: str | None = None
    for lineno, line in lines(path):
        sep = sep or ("::" if "::" in line else "\t")
        fields = line.split(sep)
        if len(fields) != 4:
            raise bad(path, lineno, f"expected 4 fields user{sep}item{sep}rating{sep}time")
        user = int_id(fields[0], path, lineno, "user id")
        item = int_id(fields[1], path, lineno, "item id")
        builder.add(user, item, parse_time(fields[3], path, lineno))
    return builder.build(path, sort_by_time=True)


def _fast_movielens(path: Path) -> InteractionLog | None:
    """A well-formed ratings file through pyarrow (``None``: read line by line).

    ``u::i::r::t`` is read as seven ``:``-separated fields whose odd ones must
    be empty (typed ``null``: anything else fails the parse)."""
    first = first_line(path)
    if first is None:
        return None
    if "::" in first:
        types = {0: pa.string(), 1: pa.null(), 2: pa.string(), 3: pa.null()}
        types |= {5: pa.null(), 6: pa.float64()}
        cols = columnar.read_delimited(path, ":", 7, types)
        names = ("c0", "c2", "c6")
    else:
        types = {0: pa.string(), 1: pa.string(), 3: pa.float64()}
        cols = columnar.read_delimited(path, "\t", 4, types)
        names = ("c0", "c1", "c3")
    if cols is None:
        return None
    return columnar.code_columns(path, cols, *names, integer_ids=True)


_AMAZON_KEYS = ("reviewerID", "asin", "unixReviewTime")
CSV_NAMES = {
    "user": ("user", "user_id", "reviewerid", "userid"),
    "item": ("item", "item_id", "asin", "parent_asin", "itemid", "movieid"),
    "time": ("timestamp", "time", "unixreviewtime"),
}


def _amazon_json_row(path: Path, lineno: int, line: str) -> tuple[str, str, tuple[int, float]]:
    """One review from a JSON line: (reviewerID, asin, unixReviewTime)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise bad(path, lineno, f"broken JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(obj, dict):
        raise bad(path, lineno, "expected a JSON object per line")
    missing = [k for k in _AMAZON_KEYS if k not in obj]
    if missing:
        raise bad(path, lineno, f"missing key(s) {missing}")
    return (
        token(obj["reviewerID"], path, lineno, "reviewerID"),
        token(obj["asin"], path, lineno, "asin"),
        parse_time(str(obj["unixReviewTime"]), path, lineno),
    )


def _csv_columns(header: list[str]) -> dict[str, int] | None:
    """Column positions from a header row, or ``None`` if it is not a header."""
    low = [h.strip().lstrip("\ufeff").lower() for h in header]  # a BOM before the header
    cols = {
        k: next((low.index(n) for n in names if n in low), -1) for k, names in CSV_NAMES.items()
    }
    return cols if min(cols.values()) >= 0 else None


def _amazon_csv_rows(
    path: Path, lines: Iterator[tuple[int, str]]
) -> Iterator[tuple[int, str, str, tuple[int, float]]]:
    """Reviews from a CSV: a named header, or headerless ``item,user,rating,timestamp``
    (2018) or ``user,item,rating,timestamp`` (2014), told apart by the ASINs."""
    first = next(lines, None)
    if first is None:
        return
    lineno, line = first[0], first[1].lstrip("\ufeff")  # a BOM before the first field
    fields = next(csv.reader([line]))
    named = _csv_columns(fields)
    if named is not None:
        cols, width, rows = named, len(fields), lines
    elif fields and not any(ch.isdigit() for f in fields for ch in f):  # names, no ids
        expected = "; ".join(f"{key}: {', '.join(names)}" for key, names in CSV_NAMES.items())
        raise bad(
            path, lineno,
            f"unrecognised header {fields}: expected a column for each of ({expected}), or "
            "no header and rows user,item,rating,timestamp",
        )  # fmt: skip
    else:
        head = [(lineno, line), *itertools.islice(lines, _LAYOUT_ROWS - 1)]
        cols, width = _headerless_layout([next(csv.reader([text])) for _, text in head]), 4
        rows = itertools.chain(head, lines)
    for lineno, line in rows:
        fields = next(csv.reader([line]))
        if len(fields) != width:
            raise bad(path, lineno, f"expected {width} comma-separated fields, got {len(fields)}")
        time = parse_time(fields[cols["time"]], path, lineno)
        user = token(fields[cols["user"]], path, lineno, "user")
        yield lineno, user, token(fields[cols["item"]], path, lineno, "item"), time


_ASIN = re.compile(r"[0-9A-Z]{9}[0-9A-ZX]")
_LAYOUT_ROWS = 200  # rows that decide a headerless file's column order


def _headerless_layout(rows: list[list[str]]) -> dict[str, int]:
    """Columns of a headerless Amazon ratings CSV from its first rows.

    The 2018 "ratings only" files put the item first, the 2014 ones the user:
    read the wrong way, every user would become an item. An ASIN is 10
    upper-case letters or digits (ISBN-10s may end in X); reviewer ids are
    mostly longer. The rows vote: one whose second column looks like an ASIN
    and whose first does not is a 2014 row, and the reverse a 2018 row; the
    2014 layout needs more votes than the 2018 one (the default).
    """
    votes = 0
    for fields in rows:
        if len(fields) < 2:
            continue
        first, second = (_ASIN.fullmatch(f.strip()) is not None for f in fields[:2])
        votes += int(second and not first) - int(first and not second)
    if votes > 0:
        return {"user": 0, "item": 1, "time": 3}
    return {"item": 0, "user": 1, "time": 3}


def _fast_amazon_csv(path: Path) -> InteractionLog | None:
    """A well-formed review CSV through pyarrow (``None``: read line by line)."""
    rows = lines(path, check_end=False)
    try:
        head = list(itertools.islice(rows, _LAYOUT_ROWS))
    finally:
        rows.close()
    if not head or head[0][0] != 1 or head[0][1].startswith("{"):
        return None
    fields = next(csv.reader([head[0][1]]))
    named = _csv_columns(fields)
    if named is not None:
        cols, width, skip = named, len(fields), 1
    else:
        cols = _headerless_layout([next(csv.reader([text])) for _, text in head])
        width, skip = 4, 0
    if len(set(cols.values())) != 3:
        return None
    types = {cols["user"]: pa.string(), cols["item"]: pa.string(), cols["time"]: pa.float64()}
    table = columnar.read_delimited(path, ",", width, types, skip_rows=skip, quoting=True)
    if table is None:
        return None
    user, item, time = (f"c{cols[k]}" for k in ("user", "item", "time"))
    return columnar.code_columns(path, table, user, item, time, integer_ids=False)


def read_amazon(path: str | Path, kcore: int = 5) -> InteractionLog:
    """Read Amazon reviews (JSON lines or CSV, optionally gzipped), then k-core.

    JSON lines need ``reviewerID``, ``asin`` and ``unixReviewTime`` (2014 and
    2018 review files). CSV rows are ``item,user,rating,timestamp`` (the 2018
    "ratings only" files, no header), ``user,item,rating,timestamp`` (the 2014
    ones, no header; recognised by ASIN-shaped second columns in the first
    rows) or have a header naming user / item / timestamp columns. Each user is
    sorted stably by time; then iterative ``kcore`` filtering (0 = off) keeps
    users and items with >= ``kcore`` interactions until nothing changes.
    """
    path = Path(path)
    fast = _fast_amazon_csv(path)
    if fast is not None:
        return kcore_filter(fast, kcore)
    builder = Builder()
    rows = lines(path)
    first = next(rows, None)
    if first is None:
        raise ValueError(f"{path}: empty file (no interactions)")
    first = (first[0], first[1].lstrip("\ufeff"))  # a BOM before the first record
    relined = itertools.chain([first], rows)
    if first[1].startswith("{"):
        for lineno, line in relined:
            user, item, time = _amazon_json_row(path, lineno, line)
            builder.add(user, item, time)
    else:
        for _, user, item, time in _amazon_csv_rows(path, relined):
            builder.add(user, item, time)
    return kcore_filter(builder.build(path, sort_by_time=True), kcore)
