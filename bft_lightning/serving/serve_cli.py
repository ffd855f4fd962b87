"""``python -m bft_lightning serve --ckpt_path best.ckpt``: recommendations over HTTP.

Start-up checks everything it can before it listens and stops with one
``error:`` line and exit status 2 otherwise: the LitServe extra installed,
the options, the port free, the checkpoint readable (it is loaded here once,
and with ``--retrieval faiss`` its item index built or read, so the model's
process starts from a checked file). Ctrl-C and SIGTERM stop the server and its
processes. Endpoints and options: ``docs/serving.md``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from typing import Any

__all__ = ["main", "missing_extra", "parser"]

EXTRA = "pip install 'bft-lightning[serve]'"


def missing_extra(*modules: str) -> str | None:
    """The one-line error when a module of the ``serve`` extra is not installed, else None."""
    import importlib.util

    for name in modules:
        if importlib.util.find_spec(name) is None:
            return f"error: {name} is not installed; the serve extra provides it: {EXTRA}"
    return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bft_lightning serve",
        description="Serve a checkpoint's recommendations over HTTP (POST /recommend, "
        "GET /health, GET /info).",
    )
    p.add_argument("--ckpt_path", required=True, help="a SequentialRecommendation checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default), 0.0.0.0 or ::")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--workers-per-device", type=int, default=1, help="model processes (default 1)")
    p.add_argument("--max-batch-size", type=int, default=32, help="bodies per batch (default 32)")
    p.add_argument(
        "--batch-timeout", type=float, default=0.002, help="seconds a batch waits (default 0.002)"
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    p.add_argument("--retrieval", default="exact", choices=("exact", "faiss"))
    p.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413 (default 1 MiB)"
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a request may wait")
    p.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"),
        help="the server's log (info: a line per request)",
    )  # fmt: skip
    return p


def _port_free(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            return f"error: --port {port}: cannot listen on {host} ({err.strerror or err})"
    return None


_MAIN_PID = os.getpid()


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM in the main process: LitServe's own clean shutdown (as Ctrl-C: workers,
    queues, sockets). The HTTP processes it forks inherit this handler and pass the
    signal on once they have shut down: there it ends the process as by default."""
    if os.getpid() == _MAIN_PID:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def main(argv: list[str] | None = None) -> int:
    """Run ``serve``; returns the exit status (2 with one ``error:`` line on bad input)."""
    opts = parser().parse_args(argv)
    missing = missing_extra("litserve", "fastapi", "uvicorn")
    if missing:
        print(missing, file=sys.stderr)
        return 2
    from .server import ServerConfig, build_server

    try:
        config = ServerConfig(**{k: v for k, v in vars(opts).items() if k != "log_level"})
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    busy = _port_free(config.host, config.port)
    if busy:
        print(busy, file=sys.stderr)
        return 2
    from .recommender import Recommender

    try:
        rec = Recommender.from_checkpoint(config.ckpt_path, retrieval=config.retrieval)
    except (ValueError, OSError) as err:
        print(f"error: --ckpt_path {err}".splitlines()[0], file=sys.stderr)
        return 2
    server = build_server(config, rec)
    del rec
    global _MAIN_PID
    _MAIN_PID = os.getpid()
    signal.signal(signal.SIGTERM, _stop)
    print(
        f"serve: {config.ckpt_path} on http://{config.host}:{config.port}/recommend "
        f"({config.retrieval} retrieval); Ctrl-C stops",
        file=sys.stderr,
    )
    try:
        server.run(host=config.host, port=config.port, num_api_servers=1,
                   log_level=opts.log_level, generate_client_file=False)  # fmt: skip
    except KeyboardInterrupt:
        pass
    return 0
