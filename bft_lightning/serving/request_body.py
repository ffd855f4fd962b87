"""The ``POST /recommend`` body: parsed and checked before it reaches the model.

One body is ``{"items": [...], "times": [...]?, "k": 10, "exclude_seen": bool?,
"user": "..."?}``; a list of such bodies is accepted too. Everything that can
be checked without the vocabulary is checked here (in the HTTP process, so a
bad request never reaches the model's batch): size, JSON, each field's type,
``k``'s range, the length of ``times``. A fault raises :class:`RequestError`
with the HTTP status and a message naming the field, as ``{"error": "..."}``
sends it. ``exclude_seen`` defaults to ``Recommender.recommend``'s own default
(:data:`EXCLUDE_SEEN_DEFAULT`, read from its signature: None, the checkpoint's
default from its training data's repeat rate), so the two never disagree.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from typing import Any

from .recommender import Recommender

__all__ = ["EXCLUDE_SEEN_DEFAULT", "RecommendRequest", "RequestError", "parse_body"]

EXCLUDE_SEEN_DEFAULT: bool | None = (
    inspect.signature(Recommender.recommend).parameters["exclude_seen"].default
)
FIELDS = ("items", "times", "k", "exclude_seen", "user")
MAX_BODIES = 1024  # bodies in one list


class RequestError(ValueError):
    """A request the client must fix: ``status`` (4xx) and a message naming the field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RecommendRequest:
    """One checked body: raw item ids (strings), times or None, k, exclude_seen, user."""

    items: list[str]
    times: list[int] | None
    k: int
    exclude_seen: bool | None
    user: str | None = None

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> RecommendRequest:
        return cls(row["items"], row["times"], row["k"], row["exclude_seen"], row["user"])


def _where(index: int | None, name: str) -> str:
    return f"field '{name}'" if index is None else f"body [{index}]: field '{name}'"


def _id(value: object, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise RequestError(400, f"{where}: expected a string or integer item id, got {value!r}")
    return str(value).strip()


def _one(row: object, index: int | None, num_items: int, needs_times: bool) -> dict[str, Any]:
    at = "body" if index is None else f"body [{index}]"
    if not isinstance(row, dict):
        raise RequestError(400, f'{at}: expected a JSON object {{"items": [...], "k": 10}}')
    extra = sorted(set(row) - set(FIELDS))
    if extra:
        raise RequestError(400, f"{_where(index, extra[0])}: unknown field (known: {FIELDS})")
    if "items" not in row:
        raise RequestError(400, f"{_where(index, 'items')}: missing (a list of item ids)")
    items = row["items"]
    if not isinstance(items, list):
        raise RequestError(400, f"{_where(index, 'items')}: expected a list, got {items!r}")
    ids = [_id(v, f"{_where(index, 'items')}[{j}]") for j, v in enumerate(items)]
    k = row.get("k", 10)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_items:
        raise RequestError(
            400, f"{_where(index, 'k')}: expected an integer in 1..{num_items}, got {k!r}"
        )
    exclude = row.get("exclude_seen", EXCLUDE_SEEN_DEFAULT)
    if exclude is not None and not isinstance(exclude, bool):  # None: the checkpoint's default
        raise RequestError(400, f"{_where(index, 'exclude_seen')}: expected true or false")
    user = row.get("user")
    if user is not None:
        user = _id(user, _where(index, "user"))
    times = _times(row.get("times"), len(ids), index)
    if times is None and needs_times and ids:
        raise RequestError(
            400, f"{_where(index, 'times')}: missing; the model was trained with timestamps "
            "(one unix time per item)"
        )  # fmt: skip
    return {"items": ids, "times": times, "k": k, "exclude_seen": exclude, "user": user}


def _times(times: object, n: int, index: int | None) -> list[int] | None:
    if times is None:
        return None
    where = _where(index, "times")
    if not isinstance(times, list):
        raise RequestError(400, f"{where}: expected a list of numbers, got {times!r}")
    if len(times) != n:
        raise RequestError(400, f"{where}: {len(times)} timestamps for {n} items (one per item)")
    out = []
    for j, t in enumerate(times):
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise RequestError(400, f"{where}[{j}]: expected a finite number, got {t!r}")
        if abs(t) >= 2**62:
            raise RequestError(400, f"{where}[{j}]: out of range")
        out.append(int(t))
    return out


def parse_body(
    body: bytes, num_items: int, needs_times: bool, max_bytes: int
) -> tuple[list[dict[str, Any]], bool]:
    """The checked bodies (plain dicts, for the model's process) and whether a list was sent.

    Raises :class:`RequestError`: 413 for a body over ``max_bytes``, 400 for
    anything else wrong with it.
    """
    if len(body) > max_bytes:
        raise RequestError(413, f"body: larger than the limit of {max_bytes} bytes")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        reason = err.msg if isinstance(err, json.JSONDecodeError) else type(err).__name__
        raise RequestError(400, f"body: not valid JSON ({reason})") from None
    if isinstance(data, list):
        if not data:
            raise RequestError(400, "body: an empty list (send one body or a list of them)")
        if len(data) > MAX_BODIES:
            raise RequestError(413, f"body: {len(data)} bodies in one list (at most {MAX_BODIES})")
        return [_one(row, i, num_items, needs_times) for i, row in enumerate(data)], True
    return [_one(data, None, num_items, needs_times)], False
