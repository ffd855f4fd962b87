"""Readers for sequential-recommendation interaction files.

Every reader returns an :class:`InteractionLog`: the raw user ids in order of
first appearance and, per user, the chronological list of raw item ids (and,
where the file has them, parallel unix timestamps).

Rules shared by all readers:

- A bad line raises ``ValueError`` whose message starts with ``<file>:<line>:``
  and says what is wrong (wrong field count, non-integer id, negative id,
  non-numeric, non-finite or out-of-range timestamp, broken JSON, missing
  key). A missing file raises ``FileNotFoundError``; a file
  with no interactions raises ``ValueError``. No row is ever dropped silently;
  blank lines are not rows and are skipped.
- Duplicates are kept as they are (Yelp users review a business again).
- Formats with timestamps (RecBole with a ``timestamp`` field, MovieLens,
  Amazon reviews) are sorted per user by timestamp; the sort is stable, so
  ties keep file order.
- Integer-id formats (S3-Rec, pairs, JSON, MovieLens) give ``int`` ids and
  reject negative ones; RecBole tokens and Amazon ids are strings.
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RawId = int | str

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
    "read_recbole",
    "read_recbole_sequential",
    "read_s3rec",
    "sniff_format",
]


@dataclass(frozen=True)
class InteractionLog:
    """Per-user chronological item sequences with raw ids.

    Attributes:
        users: raw user ids, in order of first appearance in the file.
        sequences: ``sequences[u]`` is user ``users[u]``'s raw item ids, oldest first.
        timestamps: parallel unix times per user, or ``None`` if the file has none.
        source: the file the log was read from (used in messages).
    """

    users: list[RawId]
    sequences: list[list[RawId]]
    timestamps: list[list[int]] | None = None
    source: str = ""

    @property
    def num_users(self) -> int:
        """Number of users."""
        return len(self.users)

    @property
    def num_items(self) -> int:
        """Number of distinct raw item ids."""
        return len({i for seq in self.sequences for i in seq})

    @property
    def num_interactions(self) -> int:
        """Total number of interactions (duplicates counted)."""
        return sum(len(seq) for seq in self.sequences)


# ---------------------------------------------------------------- helpers


def _bad(path: Path | str, lineno: int, what: str) -> ValueError:
    """A ``ValueError`` naming the file and line."""
    return ValueError(f"{path}:{lineno}: {what}")


def _token(value: object, path: Path | str, lineno: int, field: str) -> str:
    """A string id (user or item) from a text field or a JSON value, stripped.

    Empty, blank or null ids, and JSON values that are not strings or integers,
    raise naming the file, line and field: they would otherwise become a user or
    item called ``""`` or ``"None"``.
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _bad(path, lineno, f"{field}: expected a string or integer id, got {value!r}")
    token = str(value).strip()
    if not token:
        raise _bad(path, lineno, f"{field}: empty id")
    return token


def _check_exists(path: Path) -> None:
    """Raise ``FileNotFoundError`` naming ``path`` when it is missing."""
    if not path.is_file():
        raise FileNotFoundError(f"interaction file not found: {path}")


def _int_id(token: str, path: Path, lineno: int, what: str = "id") -> int:
    """Parse a non-negative integer id (ASCII digits) or raise a located ``ValueError``.

    Python's ``int`` also takes ``1_0`` and non-ASCII digits (``１２``), which would
    silently merge with ``10`` and ``12``: they are refused."""
    text = token.strip()
    if text.startswith("-") and _is_digits(text[1:]):
        raise _bad(path, lineno, f"negative {what} {text}; ids must be non-negative")
    if not _is_digits(text):
        raise _bad(path, lineno, f"non-integer {what} {token!r}")
    return int(text)


def _is_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


class _Seconds(int):
    """A timestamp's whole seconds (``int(value)``, what is stored) that keeps the
    rest, ``value - int(value)``, for ordering: 100.9 sorts after 100.1 although
    both store 100."""

    frac: float = 0.0


_MAX_TIME = 2**62  # int64 with room to spare (also fits millisecond timestamps)


def _int_time(token: str, path: Path, lineno: int) -> int:
    """Parse a unix timestamp (integer or float text) into whole seconds; a
    fractional one keeps its fraction for ordering (:class:`_Seconds`)."""
    try:
        value = float(token)
    except ValueError:
        raise _bad(path, lineno, f"non-numeric timestamp {token!r}") from None
    if not math.isfinite(value):
        raise _bad(path, lineno, f"non-finite timestamp {token!r}")
    if abs(value) >= _MAX_TIME:
        raise _bad(path, lineno, f"timestamp {token!r} out of range (|t| < 2**62)")
    if _is_digits(token.strip().lstrip("+-")):
        return int(token)  # exact beyond 2**53
    seconds = _Seconds(int(value))
    seconds.frac = value - int(value)
    return seconds


def _open_text(path: Path) -> io.TextIOBase:
    """Open a text file, transparently un-gzipping ``*.gz`` or gzip-magic files."""
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")  # type: ignore[return-value]
    return open(path, encoding="utf-8")  # noqa: SIM115


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield ``(line number, line)`` for non-blank lines, without the line end.

    Only the line end is taken off (not trailing tabs: a tab-separated row whose
    last field is empty keeps its field count)."""
    _check_exists(path)
    with _open_text(path) as fh:
        try:
            for lineno, line in enumerate(fh, start=1):
                line = line.rstrip("\r\n")
                if line.strip():
                    yield lineno, line
        except (OSError, EOFError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: cannot read file ({err})") from err


def _nonempty(log: InteractionLog) -> InteractionLog:
    """Raise when the log has no interactions (empty file)."""
    if not log.users:
        raise ValueError(f"{log.source}: empty file (no interactions)")
    return log


class _Builder:
    """Accumulates (user, item[, time, line]) events in file order."""

    def __init__(self) -> None:
        self.items: dict[RawId, list[RawId]] = {}
        self.times: dict[RawId, list[int]] = {}
        self.fracs: dict[RawId, list[float]] = {}  # only once a timestamp had a fraction

    def add(self, user: RawId, item: RawId, time: int | None = None) -> None:
        """Append one interaction to ``user``'s sequence."""
        self.items.setdefault(user, []).append(item)
        if time is not None:
            times = self.times.setdefault(user, [])
            frac = getattr(time, "frac", 0.0)
            if frac or user in self.fracs:
                self.fracs.setdefault(user, [0.0] * len(times)).append(frac)
            times.append(int(time))

    def build(self, path: Path, sort_by_time: bool) -> InteractionLog:
        """Make the log; optionally sort each user stably by timestamp."""
        users = list(self.items)
        seqs = [self.items[u] for u in users]
        times = [self.times[u] for u in users] if sort_by_time else None
        if times is not None:
            for k, (seq, ts) in enumerate(zip(seqs, times)):
                whole = np.asarray(ts, dtype=np.int64)
                if users[k] in self.fracs:  # by the exact time (lexsort is stable)
                    order = np.lexsort((np.asarray(self.fracs[users[k]]), whole))
                else:
                    order = np.argsort(whole, kind="stable")
                seqs[k] = [seq[j] for j in order]
                times[k] = [ts[j] for j in order]
        return _nonempty(InteractionLog(users, seqs, times, str(path)))


# ---------------------------------------------------------------- formats


def read_s3rec(path: str | Path) -> InteractionLog:
    """Read the S3-Rec format: one line per user, ``user item1 item2 ...``.

    Items are in chronological order. A user id that appears on two lines is
    an error (the order between the lines would be undefined).
    """
    path = Path(path)
    users: list[RawId] = []
    seqs: list[list[RawId]] = []
    seen: dict[int, int] = {}
    for lineno, line in _lines(path):
        fields = line.split()
        if len(fields) < 2:
            raise _bad(path, lineno, "expected 'user item1 item2 ...', got only one field")
        user = _int_id(fields[0], path, lineno, "user id")
        if user in seen:
            raise _bad(path, lineno, f"user {user} already listed on line {seen[user]}")
        seen[user] = lineno
        users.append(user)
        seqs.append([_int_id(f, path, lineno, "item id") for f in fields[1:]])
    return _nonempty(InteractionLog(users, seqs, None, str(path)))


def read_pairs(path: str | Path) -> InteractionLog:
    """Read SASRec ``user item`` pairs, one interaction per line, in time order."""
    path = Path(path)
    builder = _Builder()
    for lineno, line in _lines(path):
        fields = line.split()
        if len(fields) != 2:
            raise _bad(path, lineno, f"expected 2 fields 'user item', got {len(fields)}")
        user = _int_id(fields[0], path, lineno, "user id")
        builder.add(user, _int_id(fields[1], path, lineno, "item id"))
    return builder.build(path, sort_by_time=False)


def _json_id(value: object, where: str) -> int:
    """Validate one JSON id (a non-negative int, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: non-integer item id {value!r}")
    if value < 0:
        raise ValueError(f"{where}: negative item id {value}; ids must be non-negative")
    return value


def read_json(path: str | Path) -> InteractionLog:
    """Read a JSON object ``{"user": [item, ...]}`` (LC-Rec / MQL4GRec, 0-based ids).

    Lists are chronological. Errors name the file and, for broken JSON, the
    line and column; for bad values, the user key and list position.
    """
    path = Path(path)
    _check_exists(path)
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path}: empty file (no interactions)")
    try:  # pairs, not a dict: a repeated key must not silently replace the first
        obj = json.loads(text, object_pairs_hook=lambda pairs: pairs)
    except json.JSONDecodeError as err:
        raise _bad(path, err.lineno, f"broken JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(obj, list) or (obj and not isinstance(obj[0], tuple)):
        raise ValueError(f"{path}: expected a JSON object {{user: [items]}}")
    users: list[RawId] = []
    seqs: list[list[RawId]] = []
    seen: dict[int, str] = {}
    for key, items in obj:
        where = f"{path}: user {key!r}"
        if not _is_digits(key):
            raise ValueError(f"{where}: user key is not a non-negative integer")
        if int(key) in seen:  # "3" twice, or "3" and "03"
            raise ValueError(f"{where}: user {int(key)} appears twice (also as {seen[int(key)]!r})")
        seen[int(key)] = key
        users.append(int(key))
        if not isinstance(items, list) or not items:
            raise ValueError(f"{where}: expected a non-empty list of item ids")
        seqs.append([_json_id(v, f"{where}, position {k}") for k, v in enumerate(items)])
    return _nonempty(InteractionLog(users, seqs, None, str(path)))


def _recbole_header(path: Path, line: str) -> dict[str, int]:
    """Map RecBole field names (``name:type``) to column positions."""
    names = [f.split(":", 1)[0] for f in line.split("\t")]
    if not all(":" in f for f in line.split("\t")):
        raise _bad(path, 1, f"expected a RecBole header of 'name:type' fields, got {line!r}")
    return {name: k for k, name in enumerate(names)}


def read_recbole(path: str | Path) -> InteractionLog:
    """Read a RecBole atomic ``.inter`` file (tab separated, typed header).

    The header names ``user_id`` and ``item_id`` and optionally ``timestamp``
    (e.g. ``user_id:token\\titem_id:token\\ttimestamp:float``); each user is
    sorted stably by timestamp when present, else kept in file order. Tokens
    are kept as strings. A sequential split file (header with
    ``item_id_list``, e.g. ``Instruments.train.inter``) is delegated to
    :func:`read_recbole_sequential` with its ``.train/.valid/.test`` siblings.
    """
    path = Path(path)
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise ValueError(f"{path}: empty file (no header, no interactions)")
    cols = _recbole_header(path, first[1])
    if "item_id_list" in cols:
        return read_recbole_sequential(*_split_siblings(path))
    if "user_id" not in cols or "item_id" not in cols:
        raise _bad(path, first[0], f"header lacks user_id/item_id fields: {first[1]!r}")
    return _read_atomic(path, lines, cols)


def _read_atomic(
    path: Path, lines: Iterator[tuple[int, str]], cols: dict[str, int]
) -> InteractionLog:
    """Body of an atomic ``.inter`` file after its header."""
    builder = _Builder()
    ucol, icol, tcol = cols["user_id"], cols["item_id"], cols.get("timestamp")
    for lineno, line in lines:
        fields = _tab_fields(path, lineno, line, len(cols))
        time = None if tcol is None else _int_time(fields[tcol], path, lineno)
        user = _token(fields[ucol], path, lineno, "user_id")
        builder.add(user, _token(fields[icol], path, lineno, "item_id"), time)
    return builder.build(path, sort_by_time=tcol is not None)


def _tab_fields(path: Path, lineno: int, line: str, width: int) -> list[str]:
    """Split a tab-separated row, checking its field count."""
    fields = line.split("\t")
    if len(fields) != width:
        raise _bad(path, lineno, f"expected {width} tab-separated fields, got {len(fields)}")
    return fields


def _split_siblings(path: Path) -> tuple[Path, Path, Path]:
    """The ``X.train.inter``, ``X.valid.inter``, ``X.test.inter`` next to ``path``."""
    stem = path.name
    for part in (".train.inter", ".valid.inter", ".test.inter"):
        stem = stem.removesuffix(part)
    return tuple(path.with_name(stem + p) for p in (".train.inter", ".valid.inter", ".test.inter"))  # type: ignore[return-value]


_SeqRow = tuple[list[str], str, int]  # (history, target, line number)


def _read_seq_rows(path: Path) -> dict[str, list[_SeqRow]]:
    """Rows ``(history, target, line)`` per user of a RecBole sequential file."""
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise ValueError(f"{path}: empty file (no header, no rows)")
    cols = _recbole_header(path, first[1])
    if not {"user_id", "item_id_list", "item_id"} <= cols.keys():
        raise _bad(path, first[0], "header lacks user_id / item_id_list / item_id")
    rows: dict[str, list[_SeqRow]] = {}
    for lineno, line in lines:
        fields = _tab_fields(path, lineno, line, len(cols))
        hist = fields[cols["item_id_list"]].split()
        row = (hist, fields[cols["item_id"]].strip(), lineno)
        rows.setdefault(fields[cols["user_id"]].strip(), []).append(row)
    return rows


def read_recbole_sequential(
    train: str | Path, valid: str | Path, test: str | Path
) -> InteractionLog:
    """Rebuild full sequences from RecBole leave-one-out sequential split files.

    Each file has ``user_id / item_id_list / item_id`` rows (history, most
    recent last, possibly truncated to a window; and the target). The train
    file holds one row per prefix position ``t = 1 .. n-3`` of every user, in
    ascending or descending ``t`` order per user (the row with a one-item
    history marks which); valid and test hold one row per user. The sequence
    is ``[first item] + train targets + [valid target, test target]`` and is
    checked against every row's history; any mismatch raises ``ValueError``.
    """
    paths = [Path(p) for p in (train, valid, test)]
    for p in paths:
        _check_exists(p)
    tr, va, te = (_read_seq_rows(p) for p in paths)
    users: list[RawId] = []
    seqs: list[list[RawId]] = []
    for user in te:
        if user not in va or len(va[user]) != 1 or len(te[user]) != 1:
            raise ValueError(f"{paths[1]}/{paths[2]}: user {user!r} needs exactly one row each")
        rows = tr.get(user, [])
        seq = _rebuild(rows, va[user][0], te[user][0], f"{paths[0]}: user {user!r}")
        users.append(user)
        seqs.append(list(seq))
    extra = (tr.keys() | va.keys()) - te.keys()
    if extra:
        raise ValueError(f"{paths[2]}: users {sorted(extra)[:5]} have no test row")
    return _nonempty(InteractionLog(users, seqs, None, str(paths[0])))


def _rebuild(rows: list[_SeqRow], valid: _SeqRow, test: _SeqRow, where: str) -> list[str]:
    """One user's sequence from its train rows and valid / test rows, cross-checked."""
    ordered = _order_train_rows(rows, where)
    first = ordered[0][0] if ordered else valid[0]  # the history of the earliest row
    seq = first + [r[1] for r in [*ordered, valid, test]]
    for pos, row in enumerate([*ordered, valid, test], start=len(first)):
        hist = row[0]
        if seq[pos] != row[1] or seq[max(0, pos - len(hist)) : pos] != hist:
            raise ValueError(f"{where}: row at line {row[2]} disagrees with the rebuilt sequence")
    return seq


def _order_train_rows(rows: list[_SeqRow], where: str) -> list[_SeqRow]:
    """Train rows by ascending prefix length: the one-item history must be first or last."""
    if not rows:
        return rows
    one = [k for k, r in enumerate(rows) if len(r[0]) == 1]
    if len(one) != 1 or one[0] not in (0, len(rows) - 1):
        raise ValueError(f"{where}: cannot order train rows (no single one-item history)")
    return rows if one[0] == 0 else rows[::-1]


def read_movielens(path: str | Path) -> InteractionLog:
    """Read MovieLens ``ratings.dat`` (``u::i::r::ts``) or ``u.data`` (tab separated).

    Each user is sorted stably by timestamp. All ratings are kept (implicit
    feedback). The separator is ``::`` when the first line contains it.
    """
    path = Path(path)
    builder = _Builder()
    sep: str | None = None
    for lineno, line in _lines(path):
        sep = sep or ("::" if "::" in line else "\t")
        fields = line.split(sep)
        if len(fields) != 4:
            raise _bad(path, lineno, f"expected 4 fields user{sep}item{sep}rating{sep}time")
        user = _int_id(fields[0], path, lineno, "user id")
        item = _int_id(fields[1], path, lineno, "item id")
        builder.add(user, item, _int_time(fields[3], path, lineno))
    return builder.build(path, sort_by_time=True)


_AMAZON_KEYS = ("reviewerID", "asin", "unixReviewTime")
_CSV_NAMES = {
    "user": ("user", "user_id", "reviewerid"),
    "item": ("item", "item_id", "asin", "parent_asin"),
    "time": ("timestamp", "time", "unixreviewtime"),
}


def _amazon_json_row(path: Path, lineno: int, line: str) -> tuple[str, str, int]:
    """One review from a JSON line: (reviewerID, asin, unixReviewTime)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise _bad(path, lineno, f"broken JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(obj, dict):
        raise _bad(path, lineno, "expected a JSON object per line")
    missing = [k for k in _AMAZON_KEYS if k not in obj]
    if missing:
        raise _bad(path, lineno, f"missing key(s) {missing}")
    return (
        _token(obj["reviewerID"], path, lineno, "reviewerID"),
        _token(obj["asin"], path, lineno, "asin"),
        _int_time(str(obj["unixReviewTime"]), path, lineno),
    )


def _csv_columns(header: list[str]) -> dict[str, int] | None:
    """Column positions from a header row, or ``None`` if it is not a header."""
    low = [h.strip().lstrip("\ufeff").lower() for h in header]  # a BOM before the header
    cols = {
        k: next((low.index(n) for n in names if n in low), -1) for k, names in _CSV_NAMES.items()
    }
    return cols if min(cols.values()) >= 0 else None


def _amazon_csv_rows(
    path: Path, lines: Iterator[tuple[int, str]]
) -> Iterator[tuple[int, str, str, int]]:
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
    else:
        head = [(lineno, line), *itertools.islice(lines, _LAYOUT_ROWS - 1)]
        cols, width = _headerless_layout([next(csv.reader([text])) for _, text in head]), 4
        rows = itertools.chain(head, lines)
    for lineno, line in rows:
        fields = next(csv.reader([line]))
        if len(fields) != width:
            raise _bad(path, lineno, f"expected {width} comma-separated fields, got {len(fields)}")
        time = _int_time(fields[cols["time"]], path, lineno)
        user = _token(fields[cols["user"]], path, lineno, "user")
        yield lineno, user, _token(fields[cols["item"]], path, lineno, "item"), time


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
    builder = _Builder()
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise ValueError(f"{path}: empty file (no interactions)")
    first = (first[0], first[1].lstrip("\ufeff"))  # a BOM before the first record
    relined = _chain(first, lines)
    if first[1].startswith("{"):
        for lineno, line in relined:
            user, item, time = _amazon_json_row(path, lineno, line)
            builder.add(user, item, time)
    else:
        for _, user, item, time in _amazon_csv_rows(path, relined):
            builder.add(user, item, time)
    return kcore_filter(builder.build(path, sort_by_time=True), kcore)


def _chain(first: tuple[int, str], rest: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Put a peeked line back in front of its iterator."""
    yield first
    yield from rest


# ---------------------------------------------------------------- k-core


def kcore_filter(log: InteractionLog, k: int) -> InteractionLog:
    """Iterative k-core: keep users and items with >= ``k`` interactions until stable.

    Counts are interactions (a repeated item counts each time). Removing a
    user can push an item below ``k`` and vice versa, so both are recounted
    until a fixed point; the result is the unique maximal k-core. Order
    inside each kept sequence is unchanged. ``k <= 1`` returns ``log``.
    """
    if k <= 1:
        return log
    lengths = np.array([len(s) for s in log.sequences], dtype=np.int64)
    user = np.repeat(np.arange(len(lengths)), lengths)
    codes: dict[RawId, int] = {}
    item = np.array([codes.setdefault(i, len(codes)) for s in log.sequences for i in s], np.int64)
    keep = _kcore_mask(user, item, k)
    return _subset(log, keep, lengths)


def _kcore_mask(user: np.ndarray, item: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of interactions in the k-core (fixed-point iteration)."""
    keep = np.ones(len(user), dtype=bool)
    while True:
        ucount = np.bincount(user[keep], minlength=user.max(initial=0) + 1)
        icount = np.bincount(item[keep], minlength=item.max(initial=0) + 1)
        new = keep & (ucount[user] >= k) & (icount[item] >= k)
        if (new == keep).all():
            return keep
        keep = new


def _subset(log: InteractionLog, keep: np.ndarray, lengths: np.ndarray) -> InteractionLog:
    """The log restricted to kept interactions; users left empty are removed."""
    users: list[RawId] = []
    seqs: list[list[RawId]] = []
    times: list[list[int]] | None = None if log.timestamps is None else []
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    for u, seq in enumerate(log.sequences):
        mask = keep[bounds[u] : bounds[u + 1]]
        if mask.any():
            users.append(log.users[u])
            seqs.append([i for i, m in zip(seq, mask) if m])
            if times is not None and log.timestamps is not None:
                times.append([t for t, m in zip(log.timestamps[u], mask) if m])
    return InteractionLog(users, seqs, times, log.source)


# ---------------------------------------------------------------- dispatch

FORMATS: dict[str, Callable[..., InteractionLog]] = {
    "s3rec": read_s3rec,
    "pairs": read_pairs,
    "json": read_json,
    "recbole": read_recbole,
    "movielens": read_movielens,
    "amazon": read_amazon,
}


def sniff_format(path: str | Path) -> str:
    """Guess the format of ``path`` from its name and first lines."""
    path = Path(path)
    _check_exists(path)
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".inter"):
        return "recbole"
    if name in ("ratings.dat", "u.data"):
        return "movielens"
    if name.endswith(".csv"):
        return "amazon"
    head = [line for _, line in _take(_lines(path), 50)]
    if not head:
        raise ValueError(f"{path}: empty file (no interactions)")
    return _sniff_lines(path, head)


def _take(it: Iterator[tuple[int, str]], n: int) -> Iterator[tuple[int, str]]:
    """The first ``n`` items of ``it``."""
    for k, x in enumerate(it):
        if k >= n:
            return
        yield x


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
