"""RecBole formats: atomic ``.inter`` files and sequential split files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from . import columnar
from ._common import Builder, bad, check_exists, first_line, lines, nonempty, parse_time, token
from .log import InteractionLog, RawId

__all__ = ["read_recbole", "read_recbole_sequential"]


def _recbole_header(path: Path, line: str) -> dict[str, int]:
    """Map RecBole field names (``name:type``) to column positions."""
    names = [f.split(":", 1)[0] for f in line.split("\t")]
    if not all(":" in f for f in line.split("\t")):
        raise bad(path, 1, f"expected a RecBole header of 'name:type' fields, got {line!r}")
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
    rows = lines(path)
    first = next(rows, None)
    if first is None:
        raise ValueError(f"{path}: empty file (no header, no interactions)")
    cols = _recbole_header(path, first[1])
    if "item_id_list" in cols:
        rows.close()
        return read_recbole_sequential(*_split_siblings(path))
    if "user_id" not in cols or "item_id" not in cols:
        raise bad(path, first[0], f"header lacks user_id/item_id fields: {first[1]!r}")
    if first[0] == 1:
        rows.close()
        fast = _fast_atomic(path, cols)
        if fast is not None:
            return fast
        rows = lines(path)
        next(rows)
    return _read_atomic(path, rows, cols)


def _fast_atomic(path: Path, cols: dict[str, int]) -> InteractionLog | None:
    """A well-formed atomic file through pyarrow (``None``: read line by line)."""
    ucol, icol, tcol = cols["user_id"], cols["item_id"], cols.get("timestamp")
    types: dict[int, pa.DataType] = {ucol: pa.string(), icol: pa.string()}
    if tcol is not None:
        types[tcol] = pa.float64()
    width = len(_header_fields(path))
    if width != len(cols):
        return None  # a repeated field name: the exact reader refuses every row
    table = columnar.read_delimited(path, "\t", width, types, skip_rows=1)
    if table is None:
        return None
    time = None if tcol is None else f"c{tcol}"
    return columnar.code_columns(path, table, f"c{ucol}", f"c{icol}", time, integer_ids=False)


def _header_fields(path: Path) -> list[str]:
    first = first_line(path)
    return [] if first is None else first.split("\t")


def _read_atomic(
    path: Path, rows: Iterator[tuple[int, str]], cols: dict[str, int]
) -> InteractionLog:
    """Body of an atomic ``.inter`` file after its header."""
    builder = Builder()
    ucol, icol, tcol = cols["user_id"], cols["item_id"], cols.get("timestamp")
    for lineno, line in rows:
        fields = _tab_fields(path, lineno, line, len(cols))
        time = None if tcol is None else parse_time(fields[tcol], path, lineno)
        user = token(fields[ucol], path, lineno, "user_id")
        builder.add(user, token(fields[icol], path, lineno, "item_id"), time)
    return builder.build(path, sort_by_time=tcol is not None)


def _tab_fields(path: Path, lineno: int, line: str, width: int) -> list[str]:
    """Split a tab-separated row, checking its field count."""
    fields = line.split("\t")
    if len(fields) != width:
        raise bad(path, lineno, f"expected {width} tab-separated fields, got {len(fields)}")
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
    rows_it = lines(path)
    first = next(rows_it, None)
    if first is None:
        raise ValueError(f"{path}: empty file (no header, no rows)")
    cols = _recbole_header(path, first[1])
    if not {"user_id", "item_id_list", "item_id"} <= cols.keys():
        raise bad(path, first[0], "header lacks user_id / item_id_list / item_id")
    rows: dict[str, list[_SeqRow]] = {}
    for lineno, line in rows_it:
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
        check_exists(p)
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
    return nonempty(InteractionLog(users, seqs, None, str(paths[0])))


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
