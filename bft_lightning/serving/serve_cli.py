"""``python -m bft_lightning serve --ckpt_path best.ckpt``: recommendations over HTTP.

Start-up checks everything it can before it listens and stops with one
``error:`` line and exit status 2 otherwise: the LitServe extra installed,
the options, the port free, the checkpoint readable (it is loaded here once,
and with ``--retrieval faiss`` its item index built or read, so the model's
process starts from a checked file). Ctrl-C (SIGINT, to the process group or to
the main process alone) and SIGTERM stop the server and all its processes: exit
0 and one ``serve: stopped`` line. Endpoints and options: ``docs/serving.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
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
_STOPPED_BY: str | None = None  # the first SIGINT or SIGTERM that came
_SHUTTING_DOWN = False  # LitServe's shutdown (or ours) runs: signals are ignored


_RETRY = getattr(signal, "SIGALRM", None)  # raises the KeyboardInterrupt again


def _stop(signum: int, frame: Any) -> None:
    """SIGINT (Ctrl-C) and SIGTERM in the main process, installed whatever their inherited
    disposition (a script's ``serve ... &`` starts with SIGINT ignored): a KeyboardInterrupt,
    which LitServe's ``run`` takes for its clean shutdown (workers, queues, sockets). Until
    that shutdown starts it comes again every second (one raised in a ``__del__`` or an
    at-fork hook is swallowed); signals during it are ignored. The HTTP processes LitServe
    forks inherit this handler and pass the signal on once uvicorn has shut down: there
    it ends the process as by default."""
    global _STOPPED_BY
    if os.getpid() != _MAIN_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if signum != _RETRY:
        _STOPPED_BY = _STOPPED_BY or signal.Signals(signum).name
    if _STOPPED_BY and not _SHUTTING_DOWN:
        if _RETRY is not None:
            signal.setitimer(signal.ITIMER_REAL, 1.0)
        raise KeyboardInterrupt


def _shutting_down() -> None:
    global _SHUTTING_DOWN
    _SHUTTING_DOWN = True
    if _RETRY is not None:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _hook(server: Any) -> None:
    """Signals are ignored from the start of LitServe's graceful shutdown (one would cut
    it short). Its model processes start with SIGINT blocked (inherited through the
    spawn; ``RecommendAPI.setup`` then ignores it): a Ctrl-C while they import is not a
    traceback there, the main process stops them."""
    shutdown = getattr(server, "_perform_graceful_shutdown", None)
    if shutdown is None:  # a LitServe that shuts down otherwise: the stop still works
        print(  # (children are ended by _end_children), but may be interrupted by a signal
            "serve: warning: this LitServe version has no _perform_graceful_shutdown; a "
            "second Ctrl-C during shutdown may cut it short",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    else:

        def flagged(*args: Any, **kwargs: Any) -> Any:
            _shutting_down()
            return shutdown(*args, **kwargs)

        server._perform_graceful_shutdown = flagged
    if not hasattr(signal, "pthread_sigmask"):
        return
    for name in ("launch_inference_worker", "launch_single_inference_worker"):
        launch = getattr(server, name, None)
        if launch is not None:
            setattr(server, name, _sigint_blocked(launch))


def _sigint_blocked(launch: Any) -> Any:
    def launched(*args: Any, **kwargs: Any) -> Any:
        # Python starts multiprocessing's resource tracker at the first spawn, and that
        # unblocks SIGINT: started first, it leaves the mask below in place for the spawn
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return launch(*args, **kwargs)
        finally:  # a SIGINT that came meanwhile is delivered here
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    return launched


def _end_children(before: set[Any], limit: float = 5.0) -> None:
    """Stop the child processes not in ``before`` that LitServe has not (a signal came
    while it started them): SIGTERM, SIGKILL after ``limit`` seconds."""
    import time

    children = [c for c in multiprocessing.active_children() if c not in before]
    for child in children:
        child.terminate()
    end = time.monotonic() + limit
    for child in children:
        child.join(max(0.0, end - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join()


def main(argv: list[str] | None = None) -> int:
    """Run ``serve``; returns the exit status (2 with one ``error:`` line on bad input,
    0 once stopped by SIGINT or SIGTERM)."""
    global _MAIN_PID, _STOPPED_BY, _SHUTTING_DOWN
    opts = parser().parse_args(argv)
    before = set(multiprocessing.active_children())
    _MAIN_PID, _STOPPED_BY, _SHUTTING_DOWN = os.getpid(), None, False
    signals = [signal.SIGINT, signal.SIGTERM] + ([] if _RETRY is None else [_RETRY])
    previous = {sig: signal.signal(sig, _stop) for sig in signals}
    try:
        code = _serve(opts)
    except KeyboardInterrupt:  # a signal before LitServe's run could take it
        _shutting_down()
        code = 0
    finally:
        _shutting_down()
        _end_children(before)
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    if _STOPPED_BY and code == 0:
        print(f"serve: stopped ({_STOPPED_BY})", file=sys.stderr)
    return code


def _serve(opts: argparse.Namespace) -> int:
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
    _hook(server)
    if _STOPPED_BY:  # its KeyboardInterrupt was swallowed (raised in a __del__, say)
        return 0
    print(
        f"serve: {config.ckpt_path} on http://{config.host}:{config.port}/recommend "
        f"({config.retrieval} retrieval); Ctrl-C stops",
        file=sys.stderr,
    )
    server.run(host=config.host, port=config.port, num_api_servers=1,
               log_level=opts.log_level, generate_client_file=False)  # fmt: skip
    return 0
