"""Helpers shared by the readers: located errors, id and time parsing, line
iteration (the exact, line-by-line path) and the row builder."""

from __future__ import annotations

import codecs
import gzip
import io
import math
import re
from collections.abc import Generator
from pathlib import Path

import numpy as np

from .log import InteractionLog, RawId, from_rows, vocab_array

MAX_ID_CHARS = 256  # longer ids are refused (they are corrupt data, and widen every id array)
MAX_TIME = 2**62  # int64 with room to spare (also fits millisecond timestamps)

_BOMS = {
    codecs.BOM_UTF32_LE: "UTF-32",
    codecs.BOM_UTF32_BE: "UTF-32",
    codecs.BOM_UTF16_LE: "UTF-16",
    codecs.BOM_UTF16_BE: "UTF-16",
}


def bad(path: Path | str, lineno: int, what: str) -> ValueError:
    """A ``ValueError`` naming the file and line."""
    return ValueError(f"{path}:{lineno}: {what}")


def _check_length(token: str, path: Path | str, lineno: int, field: str) -> None:
    if len(token) > MAX_ID_CHARS:
        raise bad(path, lineno, f"{field}: id of {len(token)} characters (at most {MAX_ID_CHARS})")


def token(value: object, path: Path | str, lineno: int, field: str) -> str:
    """A string id (user or item) from a text field or a JSON value, stripped.

    Empty, blank or null ids, and JSON values that are not strings or integers,
    raise naming the file, line and field: they would otherwise become a user or
    item called ``""`` or ``"None"``.
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise bad(path, lineno, f"{field}: expected a string or integer id, got {value!r}")
    text = value.strip() if isinstance(value, str) else str(value)
    if not text:
        raise bad(path, lineno, f"{field}: empty id")
    _check_length(text, path, lineno, field)
    return text


def check_exists(path: Path) -> None:
    """Raise ``FileNotFoundError`` naming ``path`` when it is missing (``ValueError``
    when it is a directory)."""
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not an interaction file (name the file)")
    if not path.is_file():
        raise FileNotFoundError(f"interaction file not found: {path}")


_DATE = re.compile(r"^\s*\d{4}-\d{1,2}-\d{1,2}([ T].*)?$")
_NAME = re.compile(r"^\s*[A-Za-z_][A-Za-z_:]*\s*$")


def _not_a_number(tok: str) -> str:
    """Why a timestamp field is not a number: a date, a repeated header, or other text."""
    if _DATE.match(tok):
        return (
            f"timestamp {tok!r} is a date; timestamps must be unix seconds (a number), "
            "convert the column first"
        )
    if _NAME.match(tok):
        return (
            f"non-numeric timestamp {tok!r}: a header line repeated in the middle of the file? "
            "(only the first line may be a header; remove this one)"
        )
    return f"non-numeric timestamp {tok!r}"


def is_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def int_id(tok: str, path: Path, lineno: int, what: str = "id") -> int:
    """Parse a non-negative integer id (ASCII digits) or raise a located ``ValueError``.

    Python's ``int`` also takes ``1_0`` and non-ASCII digits (``１２``), which would
    silently merge with ``10`` and ``12``: they are refused; so are ids of more
    than :data:`MAX_ID_CHARS` digits."""
    text = tok.strip()
    if text.startswith("-") and is_digits(text[1:]):
        raise bad(path, lineno, f"negative {what} {text[:40]}; ids must be non-negative")
    if not is_digits(text):
        shown = tok if len(tok) <= 40 else tok[:40] + "..."
        raise bad(path, lineno, f"non-integer {what} {shown!r}")
    _check_length(text, path, lineno, what)
    return int(text)


def parse_time(tok: str, path: Path, lineno: int) -> tuple[int, float]:
    """A unix timestamp (integer or float text) as ``(whole seconds, fraction)``.

    The whole seconds (``int(value)``) are stored; the fraction only orders
    (100.9 sorts after 100.1 although both store 100)."""
    if len(tok) > 64:
        raise bad(path, lineno, f"non-numeric timestamp {tok[:40] + '...'!r}")
    try:
        value = float(tok)
    except ValueError:
        raise bad(path, lineno, _not_a_number(tok)) from None
    if not math.isfinite(value):
        raise bad(path, lineno, f"non-finite timestamp {tok!r}")
    if abs(value) >= MAX_TIME:
        raise bad(path, lineno, f"timestamp {tok!r} out of range (|t| < 2**62)")
    if is_digits(tok.strip().lstrip("+-")):
        return int(tok), 0.0  # exact beyond 2**53
    return int(value), value - int(value)


def is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def refuse_wide_unicode(path: Path, head: bytes) -> None:
    """UTF-16 / UTF-32 files (a byte-order mark) are refused with their encoding named."""
    for bom, name in _BOMS.items():
        if head.startswith(bom):
            raise ValueError(
                f"{path}: cannot read file (it starts with a {name} byte-order mark; save it "
                "as UTF-8)"
            )


def read_bytes(path: Path) -> bytes:
    """The file's bytes, un-gzipped (``*.gz`` or gzip magic), checked for UTF-16/32."""
    check_exists(path)
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:
            raise ValueError(f"{path}: cannot read file ({err})") from err
    refuse_wide_unicode(path, data[:4])
    return data


def decode(path: Path, data: bytes) -> str:
    """UTF-8 text of ``data``; a bad byte is named with its line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        lineno = data.count(b"\n", 0, err.start) + 1
        raise bad(path, lineno, f"not UTF-8 text (byte {data[err.start]:#04x})") from None


def open_text(path: Path) -> io.TextIOBase:
    """Open a text file, transparently un-gzipping ``*.gz`` or gzip-magic files."""
    if is_gzip(path):
        try:
            with gzip.open(path, "rb") as fh:
                head = fh.read(4)
        except (OSError, EOFError) as err:
            raise ValueError(f"{path}: cannot read file ({err})") from err
        refuse_wide_unicode(path, head)
        return gzip.open(path, "rt", encoding="utf-8")  # type: ignore[return-value]
    with open(path, "rb") as fh:
        refuse_wide_unicode(path, fh.read(4))
    return open(path, encoding="utf-8")  # noqa: SIM115


def lines(path: Path, check_end: bool = True) -> Generator[tuple[int, str], None, None]:
    """Yield ``(line number, line)`` for non-blank lines, without the line end.

    Only the line end is taken off (not trailing tabs: a tab-separated row whose
    last field is empty keeps its field count). A last non-blank line without a
    line end raises after it was read: the file was most likely cut while being
    written or downloaded, and its last number would be read short (``check_end=False``
    skips this, for sniffing)."""
    check_exists(path)
    last: tuple[int, bool] | None = None
    with open_text(path) as fh:
        try:
            for lineno, line in enumerate(fh, start=1):
                text = line.rstrip("\r\n")
                if text.strip():
                    last = (lineno, line.endswith("\n"))
                    yield lineno, text
        except (OSError, EOFError) as err:
            raise ValueError(f"{path}: cannot read file ({err})") from err
        except UnicodeDecodeError as err:
            lineno, byte = _first_bad_utf8(path)
            raise bad(path, lineno, f"cannot read file: not UTF-8 text (byte {byte:#04x})") from err
    if check_end and last is not None and not last[1]:
        raise bad(
            path,
            last[0],
            "the last line has no line end: the file looks truncated (a cut-off number reads "
            "as another id or time); if the file is complete, end it with a newline",
        )


def first_line(path: Path) -> str | None:
    """The first non-blank line (``None`` for a blank file)."""
    it = lines(path, check_end=False)
    try:
        first = next(it, None)
    finally:
        it.close()
    return None if first is None else first[1]


def _first_bad_utf8(path: Path) -> tuple[int, int]:
    """``(line, byte)`` of the first invalid UTF-8 sequence (only called on a decode error)."""
    opener = gzip.open if is_gzip(path) else open
    with opener(path, "rb") as fh:  # type: ignore[operator]
        for lineno, raw in enumerate(fh, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return lineno, raw[err.start]
    return lineno, 0


def nonempty(log: InteractionLog) -> InteractionLog:
    """Raise when the log has no interactions (empty file)."""
    if log.num_users == 0:
        raise ValueError(f"{log.source}: empty file (no interactions)")
    return log


class Builder:
    """Accumulates (user, item[, time]) events in file order (the line-exact path)."""

    def __init__(self) -> None:
        self.users: dict[RawId, int] = {}
        self.items: dict[RawId, int] = {}
        self.user_codes: list[int] = []
        self.item_codes: list[int] = []
        self.whole: list[int] = []
        self.frac: list[float] = []

    def add(self, user: RawId, item: RawId, time: tuple[int, float] | None = None) -> None:
        """Append one interaction to ``user``'s sequence."""
        self.user_codes.append(self.users.setdefault(user, len(self.users)))
        self.item_codes.append(self.items.setdefault(item, len(self.items)))
        if time is not None:
            self.whole.append(time[0])
            self.frac.append(time[1])

    def build(self, path: Path, sort_by_time: bool) -> InteractionLog:
        """Make the log; optionally sort each user stably by the exact timestamp."""
        users = np.array(self.user_codes, dtype=np.int64)
        items = np.array(self.item_codes, dtype=np.int64)
        times = key = None
        if sort_by_time:
            times = np.array(self.whole, dtype=np.int64)
            key = times
            if any(self.frac):  # order by (whole, fraction): the exact time
                frac = np.array(self.frac, dtype=np.float64)
                key = np.lexsort((frac, times))
                key = np.argsort(key, kind="stable")  # rank of each row's exact time
        log = from_rows(
            users, vocab_array(list(self.users)), items, vocab_array(list(self.items)),
            times, key, str(path),
        )  # fmt: skip
        return nonempty(log)
