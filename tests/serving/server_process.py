"""A ``python -m bft_lightning serve`` process on 127.0.0.1 and a small HTTP client for it."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request(port: int, method: str, path: str, body: Any = None, raw: bytes | None = None,
            timeout: float = 30.0) -> tuple[int, Any]:  # fmt: skip
    """``(status, parsed JSON or text)`` of one request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read().decode()
    finally:
        conn.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


class Server:
    """``serve`` in a subprocess (``popen``: more ``subprocess.Popen`` options), stopped with
    SIGTERM by :meth:`stop` (its exit status; its output is in ``log``)."""

    def __init__(self, ckpt: Path, *options: str, log: Path, **popen: Any) -> None:
        self.port = free_port()
        self.log = log
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "bft_lightning", "serve", "--ckpt_path", str(ckpt),
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
               *options]  # fmt: skip
        self._err = open(log, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._err, stderr=self._err, cwd=REPO, env=env, **popen
        )

    def wait_ready(self, limit: float = 180.0) -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}: {self.log.read_text()}")
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"serve did not answer /health in {limit} s: {self.log.read_text()}")

    def stop(self, limit: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(limit)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()
        return int(self.proc.returncode)
