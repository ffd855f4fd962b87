"""Processes that open one new study database at the same moment all get it.

Optuna creates an SQLite database's tables and stamps its schema version on first
open; two processes doing that at once (tune workers, a second machine, a monitor
reading the study) collide on the version row, and the loser used to die with an
``IntegrityError`` before its first trial.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from bft_lightning.tuning.study import make_storage  # noqa: E402


def _open(url: str, barrier, results) -> None:  # noqa: ANN001 - multiprocessing handles
    barrier.wait()
    try:
        storage = make_storage(url, heartbeat=1)
        results.put(("ok", storage.get_all_studies() == []))
    except Exception as err:  # noqa: BLE001 - reported to the parent
        results.put((type(err).__name__, str(err)[:200]))


def test_processes_opening_a_new_database_at_once_all_succeed(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    for round_ in range(4):
        url = f"sqlite:///{tmp_path}/r{round_}/study.db"
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open, args=(url, barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert outcomes == [("ok", True)] * 4, outcomes


def test_an_unopenable_database_fails_at_once(tmp_path: Path) -> None:
    """Only the creation race is retried: a path that cannot be a database fails fast."""
    import time

    from sqlalchemy.exc import OperationalError

    (tmp_path / "dir.db").mkdir()
    start = time.monotonic()
    with pytest.raises(OperationalError):
        make_storage(f"sqlite:///{tmp_path}/dir.db", heartbeat=1)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped_by_optuna"])
def test_a_locked_database_is_opened_again(tmp_path: Path, monkeypatch, wrapped) -> None:  # noqa: ANN001
    """'database is locked' while another process stamps the schema, raised as it is or
    inside Optuna's StorageInternalError, is retried; the third try opens it."""
    import optuna.storages
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import OperationalError

    real, calls = optuna.storages.RDBStorage, []

    def flaky(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) < 3:
            locked = OperationalError("INSERT ...", {}, Exception("database is locked"))
            if not wrapped:
                raise locked
            raise StorageInternalError("An exception is raised during the commit.") from locked
        return real(*args, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", flaky)
    storage = make_storage(f"sqlite:///{tmp_path}/study.db", heartbeat=1)
    assert len(calls) == 3 and storage.get_all_studies() == []
