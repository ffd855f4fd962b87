"""``python -m bft_lightning recommend --ckpt_path CKPT --input FILE --output FILE --k 10``.

Input, one history per user:

- JSON lines (``.jsonl``, ``.ndjson``, ``.json``): ``{"user": "u1", "items": ["B00X1",
  "B00Q7"], "times": [1390000000, 1390086400]}``, items oldest first; an empty
  list is a cold user; ``times`` (optional) holds one unix timestamp per item.
- CSV (``.csv``): ``user,item[,timestamp]``, one interaction a row, an optional
  header (``user,item,timestamp``). A user's rows must be contiguous (sorted
  or grouped by user); within a user they are ordered by timestamp when
  there is one (stable), else kept in file order.

Timestamps reach the model where it reads them (HSTU trained with
timestamps, whose attention has a learned time bias; ``docs/recommend.md``).
For such a checkpoint every non-empty history needs them (a ``times`` field or
the timestamp column), else the line is refused; other models ignore them.

Output (``.csv`` or ``.jsonl``): one row per (user, rank, item, score,
confidence). Histories are read, ranked and written in batches of
``--batch-size``, so the input never sits in memory at once; the output is
written to a temporary file and renamed at the end. Bad input stops with
``error: FILE:LINE: what`` and exit status 2, leaving no output.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import IO, NamedTuple

from .recommender import Recommender
from .rows import RowWriter, output_format

__all__ = ["History", "InputError", "main", "read_csv", "read_histories", "read_jsonl"]

_INPUT_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv"}


class InputError(ValueError):
    """Bad input: the message names the file and line (or the option)."""


class History(NamedTuple):
    """One user's items (raw ids, oldest first), the line it starts on, and the
    items' timestamps (unix seconds, whole) or None."""

    user: str
    items: list[str]
    line: int
    times: list[int] | None = None


def _id(value: object, path: Path, line: int, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InputError(f"{path}:{line}: {field}: expected a string or integer id, got {value!r}")
    text = str(value).strip()
    if not text:
        raise InputError(f"{path}:{line}: {field}: empty id")
    return text


def _text_lines(fh: IO[bytes], path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a file opened in binary, decoded line by line, so that an
    undecodable byte is reported on its own line (a text-mode reader decodes in chunks)."""
    for line, raw in enumerate(fh, start=1):
        try:
            yield line, raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"{path}:{line}: not UTF-8 text ({err.reason})") from None


def read_jsonl(path: str | Path) -> Iterator[History]:
    """Histories from JSON lines, lazily; blank lines are skipped."""
    path = Path(path)
    seen: dict[str, int] = {}  # user -> its line (a user is one history, as in CSV)
    with open(path, "rb") as fh:
        for line, text in _text_lines(fh, path):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{line}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f'{path}:{line}: expected a JSON object {{"user", "items"}}')
            for key in ("user", "items"):
                if key not in row:
                    raise InputError(f"{path}:{line}: missing field {key!r}")
            items = row["items"]
            if not isinstance(items, list):
                raise InputError(
                    f"{path}:{line}: field 'items': expected a list of item ids, got {items!r}"
                )
            user = _id(row["user"], path, line, "field 'user'")
            if user in seen:
                raise InputError(
                    f"{path}:{line}: user {user!r} already has a history on line {seen[user]}: "
                    "one line per user (merge the lines)"
                )
            seen[user] = line
            ids = [_id(v, path, line, f"field 'items'[{j}]") for j, v in enumerate(items)]
            yield History(user, ids, line, _json_times(row.get("times"), len(ids), path, line))


def _json_times(times: object, n: int, path: Path, line: int) -> list[int] | None:
    if times is None:
        return None
    if not isinstance(times, list):
        raise InputError(f"{path}:{line}: field 'times': expected a list of numbers, got {times!r}")
    if len(times) != n:
        raise InputError(
            f"{path}:{line}: field 'times': {len(times)} timestamps for {n} items (one per item)"
        )
    out = []
    for j, t in enumerate(times):
        if isinstance(t, bool) or not isinstance(t, int | float):
            raise InputError(f"{path}:{line}: field 'times'[{j}]: expected a number, got {t!r}")
        value = float(t)
        if value != value or abs(value) >= 2**62:
            raise InputError(f"{path}:{line}: field 'times'[{j}]: expected a finite number")
        out.append(int(t))
    return out


_USER, _ITEM, _TIME = ("user", "user_id", "userid"), ("item", "item_id", "itemid"), (
    "timestamp", "time", "ts",
)  # fmt: skip


def _header(fields: list[str], path: Path, line: int) -> dict[str, int] | None:
    names = [f.strip().lower() for f in fields]
    if not names or names[0] not in _USER + _ITEM + _TIME:
        return None
    columns: dict[str, int] = {}
    for key, options in (("user", _USER), ("item", _ITEM), ("timestamp", _TIME)):
        found = [j for j, name in enumerate(names) if name in options]
        if found:
            columns[key] = found[0]
    if "user" not in columns or "item" not in columns:
        raise InputError(
            f"{path}:{line}: header {fields} lacks a 'user' or an 'item' column "
            "(expected user,item[,timestamp])"
        )
    return columns


def _timestamp(text: str, path: Path, line: int) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{path}:{line}: timestamp: expected a number, got {text!r}") from None
    if value != value or abs(value) >= 2**62:
        raise InputError(f"{path}:{line}: timestamp: expected a finite number, got {text!r}")
    return value


def _whole(text: str, value: float) -> int:
    """Whole seconds as the data readers store them (exact for integer text)."""
    stripped = text.strip()
    return int(stripped) if stripped.lstrip("+-").isdigit() else int(value)


def read_csv(path: str | Path) -> Iterator[History]:
    """Histories from ``user,item[,timestamp]`` rows, lazily, one user at a time.

    A user whose rows are not contiguous is an error naming the line (its
    history would otherwise be split in two). Only the ids of finished users
    are kept, to detect that.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        reader = csv.reader(line for _, line in _text_lines(fh, path))
        columns: dict[str, int] | None = None
        width: int | None = None
        done: dict[str, int] = {}
        user: str | None = None
        first = 0
        rows: list[tuple[float, str, int]] = []
        timed = False
        try:
            for fields in reader:
                line = reader.line_num
                if not fields or all(not f.strip() for f in fields):
                    continue
                if width is None:
                    columns = _header(fields, path, line)
                    width = len(fields)
                    if columns is not None:
                        continue
                    if width not in (2, 3):
                        raise InputError(
                            f"{path}:{line}: expected 2 or 3 fields user,item[,timestamp], "
                            f"got {width}"
                        )
                    columns = {"user": 0, "item": 1} | ({"timestamp": 2} if width == 3 else {})
                    timed = width == 3
                elif len(fields) != width:
                    raise InputError(f"{path}:{line}: expected {width} fields, got {len(fields)}")
                assert columns is not None
                timed = "timestamp" in columns
                u = _id(fields[columns["user"]], path, line, "user")
                item = _id(fields[columns["item"]], path, line, "item")
                t, whole = 0.0, 0
                if timed:
                    text = fields[columns["timestamp"]]
                    t = _timestamp(text, path, line)
                    whole = _whole(text, t)
                if u != user:
                    if u in done:
                        raise InputError(
                            f"{path}:{line}: user {u!r} already had rows ending at line "
                            f"{done[u]}: a user's rows must be contiguous (group the file by user)"
                        )
                    if user is not None:
                        done[user] = line - 1
                        yield _finish(user, rows, first, timed)
                    user, first, rows = u, line, []
                rows.append((t, item, whole))
        except csv.Error as err:
            raise InputError(f"{path}:{reader.line_num}: {err}") from None
        if user is not None:
            yield _finish(user, rows, first, timed)


def _finish(user: str, rows: list[tuple[float, str, int]], line: int, timed: bool) -> History:
    if timed:
        rows = sorted(rows, key=lambda r: r[0])  # stable: equal times keep file order
    times = [whole for _, _, whole in rows] if timed else None
    return History(user, [item for _, item, _ in rows], line, times)


def read_histories(path: str | Path, fmt: str | None = None) -> Iterator[History]:
    """Histories of a ``jsonl`` or ``csv`` file (``fmt``, else from its suffix), lazily."""
    path = Path(path)
    fmt = fmt or _INPUT_SUFFIXES.get(path.suffix.lower())
    if fmt not in ("jsonl", "csv"):
        raise InputError(
            f"{path}: cannot tell the input format from the suffix; name it .jsonl or .csv "
            "(or pass --input-format)"
        )
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not an input file")
    if not path.is_file():
        raise InputError(f"{path}: input file not found")
    return read_jsonl(path) if fmt == "jsonl" else read_csv(path)


def batched(items: Iterable[History], size: int) -> Iterator[list[History]]:
    """Successive lists of ``size`` items (the last may be shorter), lazily."""
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bft_lightning recommend",
        description="Top-k next items for each history of a file, from a checkpoint.",
    )
    p.add_argument("--ckpt_path", required=True, help="a SequentialRecommendation checkpoint")
    p.add_argument("--input", required=True, help="histories: .jsonl ({user, items}) or .csv")
    p.add_argument(
        "--output", required=True, help=".csv or .jsonl: user,rank,item,score,confidence"
    )
    p.add_argument("--k", type=int, default=10, help="items per user (1..num_items; default 10)")
    seen = p.add_mutually_exclusive_group()
    seen.add_argument(
        "--exclude-seen", dest="exclude_seen", action="store_true", default=None,
        help="never recommend a history's items (default: the checkpoint's, from how often "
        "its training data repeats an item; the summary says which applied)",
    )  # fmt: skip
    seen.add_argument(
        "--keep-seen", dest="exclude_seen", action="store_false",
        help="let a history's items be recommended",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=256, help="histories per batch (default 256)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument(
        "--retrieval", choices=("exact", "faiss"), default="exact",
        help="faiss: an approximate item index for large catalogues (docs/serving.md)",
    )  # fmt: skip
    p.add_argument("--input-format", choices=("jsonl", "csv"), default=None)
    p.add_argument("--output-format", choices=("csv", "jsonl"), default=None)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``recommend``; returns the exit status (2 on bad input, with one ``error:`` line).

    ``--debug`` (or ``BFT_DEBUG=1``) lets the error's traceback through."""
    from bft_lightning.utils.errors import debug_requested

    debug, rest = debug_requested(list(sys.argv[1:] if argv is None else argv))
    opts = parser().parse_args(rest)
    try:
        summary = run(opts)
    except (InputError, ValueError) as err:
        if debug:
            raise
        print(f"error: {str(err).removeprefix('error: ')}", file=sys.stderr)
        return 2
    print(summary, file=sys.stderr)
    return 0


def run(opts: argparse.Namespace) -> str:
    """Read, rank, write; raises ``InputError`` on anything the user must fix."""
    if opts.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {opts.batch_size}")
    from bft_lightning.utils.devices import check_device
    from bft_lightning.utils.outputs import check_output

    try:
        output_format(opts.output, opts.output_format)
    except ValueError as err:
        raise InputError(f"--output {err}") from None
    opts.overwrite_existing = check_output(
        opts.output, [opts.input, opts.ckpt_path], opts.overwrite
    )
    check_device(opts.device, "--device")
    histories = read_histories(opts.input, opts.input_format)
    try:
        rec = Recommender.from_checkpoint(
            opts.ckpt_path, device=opts.device, retrieval=opts.retrieval
        )
    except (ValueError, FileNotFoundError) as err:
        raise InputError(f"--ckpt_path {err}") from None
    except RuntimeError as err:  # e.g. a CUDA device that is not there
        raise InputError(f"--device {opts.device}: {str(err).splitlines()[0]}") from None
    try:
        k = rec.check_k(opts.k)
    except ValueError as err:
        raise InputError(f"--k {opts.k}: {err}") from None
    from bft_lightning.retrieval.seen_default import resolve_exclude_seen

    opts.exclude_seen, opts.seen_why = resolve_exclude_seen(opts.exclude_seen, rec.repeat_rate)
    return _write(rec, histories, k, opts)


def _write(rec: Recommender, histories: Iterator[History], k: int, opts: argparse.Namespace) -> str:
    from tqdm import tqdm

    rows = RowWriter(opts.output, opts.output_format)
    users = unknown = unknown_users = cold = 0
    first_timed: History | None = None  # the first history the model reads, with its times
    bar = tqdm(unit=" users", disable=True if opts.no_progress else None, file=sys.stderr)
    try:
        for batch in batched(histories, opts.batch_size):
            encoded = []
            for h in batch:
                if rec.uses_times and h.items:
                    first_timed = first_timed or h
                    if (h.times is None) != (first_timed.times is None):
                        has = "has" if h.times is not None else "has no"
                        raise InputError(
                            f"{opts.input}:{h.line}: user {h.user!r}: {has} times, unlike the "
                            f"history on line {first_timed.line}: give every history times or none"
                        )
                try:
                    encoded.append(rec.encode(h.items, h.line, h.times))
                except ValueError as err:  # UnknownItemsError, times
                    raise InputError(
                        f"{opts.input}:{h.line}: user {h.user!r}: " + str(err).split(": ", 1)[1]
                    ) from None
            for h, r in zip(batch, rec.recommend_encoded(encoded, k, opts.exclude_seen)):
                rows.write(h.user, r.items, r.scores, r.confidence)
                unknown += len(r.unknown)
                unknown_users += bool(r.unknown)
                cold += r.cold
            users += len(batch)
            bar.update(len(batch))
        path = rows.commit()
    except BaseException:
        rows.abort()
        raise
    finally:
        bar.close()
    replaced = " (replaced the existing file: --overwrite)" if opts.overwrite_existing else ""
    return (
        f"recommend: {users} users, {rows.rows} rows written to {path}{replaced}; {unknown} "
        f"unknown item ids skipped in {unknown_users} histories; {cold} cold users (empty "
        f"history: popularity); {opts.seen_why}"
    )
