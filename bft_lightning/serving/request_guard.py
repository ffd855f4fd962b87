"""An ASGI middleware that checks ``POST /recommend`` bodies in the HTTP process.

It reads at most ``max_bytes`` of the body (more is refused with 413 without
reading the rest), parses and checks it (:func:`.request_body.parse_body`) and
answers a bad one with its 4xx and ``{"error": "..."}`` at once: a bad request
costs the HTTP process one parse and never reaches the model's batch, so it
neither fails nor slows the requests batched with it. A good body is passed on
re-encoded as ``{"bodies": [...], "list": bool}``, the checked form the model's
process reads.
"""

from __future__ import annotations

import json
from typing import Any

from .request_body import RequestError, parse_body

__all__ = ["RequestGuard", "error_body"]

Scope = dict[str, Any]


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class RequestGuard:
    """Checks the bodies sent to ``path``; every other request passes untouched."""

    def __init__(
        self, app: Any, path: str, num_items: int, needs_times: bool, max_bytes: int
    ) -> None:
        self.app, self.path = app, path
        self.num_items, self.needs_times, self.max_bytes = num_items, needs_times, max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _answer(send, 405, f"{self.path}: use POST with a JSON body")
            return
        try:
            body = await self._read(scope, receive)
            rows, is_list = parse_body(body, self.num_items, self.needs_times, self.max_bytes)
        except RequestError as err:
            await _answer(send, err.status, str(err))
            return
        checked = json.dumps({"bodies": rows, "list": is_list}).encode()
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length",
                   b"content-type", b"content-encoding", b"transfer-encoding")]  # fmt: skip
        headers += [(b"content-type", b"application/json"),
                    (b"content-length", str(len(checked)).encode())]  # fmt: skip
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": checked, "more_body": False}
            return await receive()  # a disconnect, as the client sends it

        await self.app({**scope, "headers": headers}, replay, send)

    async def _read(self, scope: Scope, receive: Any) -> bytes:
        """The body, or ``RequestError`` 413 as soon as it is known to be too large."""
        for key, value in scope["headers"]:
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                raise RequestError(413, f"body: larger than the limit of {self.max_bytes} bytes")
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestError(400, "body: the client disconnected while sending it")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise RequestError(413, f"body: larger than the limit of {self.max_bytes} bytes")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


async def _answer(send: Any, status: int, message: str) -> None:
    body = error_body(message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})
