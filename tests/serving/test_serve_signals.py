"""Ctrl-C and SIGTERM stop ``python -m bft_lightning serve`` and all its processes.

A terminal's Ctrl-C is SIGINT to the whole foreground process group: the main
process, LitServe's HTTP (uvicorn) and model processes, multiprocessing's
manager and resource tracker. Each case starts the real server in its own
process group on a real socket, waits for ``/health``, sends the signal and
expects every process of the group gone within a deadline, exit status 0 and
one ``serve: stopped`` line, no traceback. ``SIGINT ignored`` starts the
server as a script's ``serve ... &`` does: a non-interactive shell starts
background commands with SIGINT ignored, which Python keeps.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("litserve")
if not sys.platform.startswith("linux"):
    pytest.skip("reads the process group from /proc", allow_module_level=True)

from server_process import Server  # noqa: E402

DEADLINE = 15.0  # seconds from the signal until no process of the group is left


def _group(pgid: int) -> list[str]:
    """``pid state command`` of the live (not zombie) processes of process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            out.append(f"{entry.name} {state} {cmd.strip()}")
    return out


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


SLOW = pytest.mark.slow  # ~15 s each; test_server's fixture checks SIGTERM too


@pytest.mark.parametrize(
    ("signum", "to_group", "sigint_ignored"),
    [
        # Ctrl-C in a terminal
        pytest.param(signal.SIGINT, True, False, id="SIGINT-group", marks=SLOW),
        # Ctrl-C / kill -INT -PGID of a script's `serve ... &`: it ignored Ctrl-C
        pytest.param(signal.SIGINT, True, True, id="SIGINT-group-inherited-ignore"),
        # kill -INT PID of a script's `serve ... &`
        pytest.param(signal.SIGINT, False, True, id="SIGINT-main-inherited-ignore", marks=SLOW),
        # kill PID, docker stop
        pytest.param(signal.SIGTERM, False, False, id="SIGTERM-main", marks=SLOW),
    ],
)
def test_signal_stops_every_process(trained, tmp_path: Path, signum, to_group, sigint_ignored):
    server = Server(trained[0], log=tmp_path / "serve.log", start_new_session=True,
                    preexec_fn=_ignore_sigint if sigint_ignored else None)  # fmt: skip
    pgid = server.proc.pid
    try:
        server.wait_ready()
        assert len(_group(pgid)) >= 3, _group(pgid)  # main, HTTP and model processes at least
        (os.killpg if to_group else os.kill)(pgid, signum)
        end = time.monotonic() + DEADLINE
        while (server.proc.poll() is None or _group(pgid)) and time.monotonic() < end:
            time.sleep(0.2)
        left, code = _group(pgid), server.proc.poll()
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.stop()
    log = server.log.read_text()
    assert not left, f"still running {DEADLINE} s after {signum.name}: {left}\n{log}"
    assert code == 0, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert log.strip().splitlines()[-1] == f"serve: stopped ({signum.name})", log
