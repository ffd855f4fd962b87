"""``POST /recommend`` on LitServe: the model's process (:class:`RecommendAPI`) and the server.

The HTTP process checks each body (:mod:`.request_guard`) and LitServe queues
the good ones for the model's process, which batches concurrent requests
(``max_batch_size`` bodies, waiting at most ``batch_timeout`` seconds for
them) and answers each with ``Recommender.recommend_encoded``: the same items,
scores, confidence, unknown ids and cold flag as ``Recommender.recommend``.
Bodies in one batch are ranked together where they share ``k``,
``exclude_seen`` and whether they carry times (one ``recommend_encoded`` call
each); a history of only unknown ids fails its own request (422) and no other.
"""

from __future__ import annotations

import signal
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import litserve as ls
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .histories import EncodedHistory
from .recommender import Recommendation, Recommender
from .request_body import RecommendRequest
from .request_guard import RequestGuard

__all__ = ["RecommendAPI", "ServerConfig", "build_server", "info_of"]

API_PATH = "/recommend"


@dataclass(frozen=True)
class ServerConfig:
    """What ``python -m bft_lightning serve`` starts (its options, ``docs/serving.md``)."""

    ckpt_path: str
    host: str = "127.0.0.1"
    port: int = 8000
    workers_per_device: int = 1
    max_batch_size: int = 32
    batch_timeout: float = 0.002
    device: str = "cpu"
    retrieval: str = "exact"
    max_body_bytes: int = 1 << 20
    timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("workers_per_device", "max_batch_size", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")
        if not 0 <= self.batch_timeout < self.timeout:
            raise ValueError(
                f"--batch-timeout must be in [0, {self.timeout}) (--timeout), "
                f"got {self.batch_timeout}"
            )
        if self.host not in ("127.0.0.1", "0.0.0.0", "::"):
            raise ValueError(f"--host must be 127.0.0.1, 0.0.0.0 or ::, got {self.host!r}")
        if not 1024 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1024..65535, got {self.port}")
        if self.device != "cpu" and self.device != "cuda":
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")


def _answer(r: Recommendation, user: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"items": list(r.items), "scores": list(r.scores),
                           "confidence": r.confidence, "unknown": list(r.unknown),
                           "cold": r.cold}  # fmt: skip
    if user is not None:
        out["user"] = user
    return out


class RecommendAPI(ls.LitAPI):
    """The model's process: a ``Recommender`` from the checkpoint, one batch at a time."""

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(
            max_batch_size=config.max_batch_size,
            batch_timeout=config.batch_timeout,
            api_path=API_PATH,
        )
        self.config = config

    def setup(self, device: str) -> None:
        # Ctrl-C reaches every process of the terminal's group; the server's main process
        # stops this one (SIGTERM, after the HTTP side): not a KeyboardInterrupt mid-batch
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.rec = Recommender.from_checkpoint(
            self.config.ckpt_path, device=device, retrieval=self.config.retrieval
        )

    # no annotations on these two: LitServe reads them as the endpoint's request and
    # response types (a Request and a Response, its defaults)
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        return request  # checked by the guard: {"bodies": [...], "list": bool}

    def batch(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return inputs

    def unbatch(self, output: list[Any]) -> list[Any]:
        return output

    def predict(self, x: Any) -> Any:
        """One answer per request of the batch (a single request when not batching)."""
        if self.max_batch_size == 1:
            return self.answer([x])[0]
        return self.answer(x)

    def answer(self, requests: list[dict[str, Any]]) -> list[tuple[int, Any]]:
        """``(status, JSON)`` per request: ranked together where the options agree."""
        rec = self.rec
        bodies = [[RecommendRequest.from_dict(b) for b in r["bodies"]] for r in requests]
        failed: dict[int, tuple[int, Any]] = {}
        groups: dict[tuple[int, bool, bool], list[tuple[int, int, EncodedHistory]]]
        groups = defaultdict(list)
        default_seen = rec.exclude_seen_default[0]  # a body without "exclude_seen" gets it
        for i, (request, rows) in enumerate(zip(requests, bodies, strict=True)):
            for j, body in enumerate(rows):
                try:
                    encoded = rec.encode(body.items, j, body.times)
                except ValueError as err:  # only unknown ids, times
                    where = f"body [{j}]: " if request["list"] else ""
                    detail = str(err).split(": ", 1)[-1]
                    failed[i] = (422, {"error": f"{where}field 'items': {detail}"})
                    break
                exclude = default_seen if body.exclude_seen is None else body.exclude_seen
                key = (body.k, exclude, encoded.times is not None)
                groups[key].append((i, j, encoded))
        results: dict[tuple[int, int], Recommendation] = {}
        for (k, exclude_seen, _), members in groups.items():
            members = [m for m in members if m[0] not in failed]
            for start in range(0, len(members), 256):
                part = members[start : start + 256]
                ranked = rec.recommend_encoded([e for _, _, e in part], k, exclude_seen)
                results.update({(i, j): r for (i, j, _), r in zip(part, ranked, strict=True)})
        out: list[tuple[int, Any]] = []
        for i, (request, rows) in enumerate(zip(requests, bodies, strict=True)):
            if i in failed:
                out.append(failed[i])
                continue
            answers = [_answer(results[i, j], b.user) for j, b in enumerate(rows)]
            out.append((200, answers if request["list"] else answers[0]))
        return out

    def encode_response(self, output):  # type: ignore[no-untyped-def]
        status, content = output
        return JSONResponse(content, status_code=status)


def info_of(rec: Recommender, config: ServerConfig) -> dict[str, Any]:
    """What ``GET /info`` answers: the model, its data and how it is served."""
    return {
        "model": type(rec.model).__name__,
        "precision": rec.model.precision,
        "items": rec.num_items,
        "max_len": rec.max_len,
        "data_fingerprint": rec.fingerprint,
        "needs_times": rec.needs_times,
        "uses_times": rec.uses_times,
        "retrieval": config.retrieval,
        # a request without "exclude_seen" gets this, and why (retrieval.seen_default)
        "exclude_seen_default": dict(zip(("value", "why"), rec.exclude_seen_default)),
        "confidence": rec.describe()["confidence"],
        "max_batch_size": config.max_batch_size,
        "batch_timeout": config.batch_timeout,
        "max_body_bytes": config.max_body_bytes,
    }


def build_server(config: ServerConfig, rec: Recommender) -> ls.LitServer:
    """The LitServer for ``config``; ``rec`` (the checkpoint, loaded and checked by the
    caller) gives the guard its limits and ``/info`` its answer."""
    guard = {"path": API_PATH, "num_items": rec.num_items, "needs_times": rec.needs_times,
             "max_bytes": config.max_body_bytes}  # fmt: skip
    server = ls.LitServer(
        RecommendAPI(config),
        accelerator=config.device,
        devices=1,
        workers_per_device=config.workers_per_device,
        timeout=config.timeout,
        info_path="/litserve/info",
        middlewares=[(RequestGuard, guard)],
    )
    info = info_of(rec, config)

    async def get_info(request: Request) -> JSONResponse:
        return JSONResponse(info)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        return JSONResponse({"error": str(detail)}, status_code=status)

    server.app.add_api_route("/info", get_info, methods=["GET"])
    server.app.add_exception_handler(HTTPException, http_error)
    return server
