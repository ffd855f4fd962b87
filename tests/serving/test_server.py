"""``python -m bft_lightning serve``: a real server process on 127.0.0.1 from a small trained
checkpoint answers ``/recommend`` as ``Recommender.recommend`` does (one body and a list),
keeps concurrent answers apart, answers each bad request class with its 4xx and keeps
answering, fails start-up in one line, and stops cleanly on SIGTERM."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("litserve")

from server_process import Server, free_port, request  # noqa: E402

from bft_lightning.serving import Recommender  # noqa: E402
from bft_lightning.serving.request_body import EXCLUDE_SEEN_DEFAULT  # noqa: E402


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory):
    """(server, recommender) of the cyclic checkpoint; SIGTERM at the end must exit 0."""
    ckpt = trained[0]
    server = Server(ckpt, "--max-batch-size", "8", "--batch-timeout", "0.01",
                    "--max-body-bytes", "4096",
                    log=tmp_path_factory.mktemp("serve") / "serve.log")  # fmt: skip
    try:
        server.wait_ready()
        yield server, Recommender.from_checkpoint(ckpt)
    finally:
        code = server.stop()
    log = server.log.read_text()
    assert code == 0, log
    assert "Traceback" not in log, log


def _as_json(rec, user=None) -> dict:
    out = {"items": rec.items, "scores": rec.scores, "confidence": rec.confidence,
           "unknown": list(rec.unknown), "cold": rec.cold}  # fmt: skip
    return out if user is None else {**out, "user": user}


def test_recommend_answers_as_the_recommender(served) -> None:
    server, rec = served
    status, got = request(server.port, "POST", "/recommend", {"items": ["1003", "1004"], "k": 5})
    assert status == 200
    assert got == _as_json(rec.recommend([["1003", "1004"]], k=5)[0])  # the same values
    bodies = [
        {"items": ["1001", "1002", "zzz"], "k": 3, "exclude_seen": True, "user": "u1"},
        {"items": [], "k": 4},  # cold
        {"items": [1010, "1011"], "exclude_seen": False},
    ]
    status, got = request(server.port, "POST", "/recommend", bodies)
    assert status == 200 and isinstance(got, list) and len(got) == 3
    assert got[0] == _as_json(rec.recommend([bodies[0]["items"]], k=3, exclude_seen=True)[0], "u1")
    assert got[0]["unknown"] == ["zzz"] and "1001" not in got[0]["items"]
    assert got[1] == _as_json(rec.recommend([[]], k=4)[0]) and got[1]["cold"] is True
    assert got[2] == _as_json(rec.recommend([bodies[2]["items"]], exclude_seen=False)[0])
    # exclude_seen left out: Recommender.recommend's own default
    status, got = request(server.port, "POST", "/recommend", {"items": ["1005"], "k": 20})
    want = rec.recommend([["1005"]], k=20, exclude_seen=EXCLUDE_SEEN_DEFAULT)[0]
    assert got == _as_json(want)
    # the checkpoint's default: its training users never repeat an item, so seen items go
    assert "1005" not in got["items"] and len(got["items"]) == 19


def test_concurrent_requests_get_their_own_answers(served) -> None:
    server, rec = served
    histories = [[str(1001 + (start + j) % 20) for j in range(1 + start % 5)]
                 for start in range(40)]  # fmt: skip
    want = rec.recommend(histories, k=3)

    def ask(i: int) -> tuple[int, dict]:
        return request(server.port, "POST", "/recommend", {"items": histories[i], "k": 3})

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(len(histories))))
    for (status, got), expected in zip(answers, want):
        assert status == 200
        assert got["items"] == expected.items
        assert got["scores"] == pytest.approx(expected.scores, abs=1e-5)


BAD = [
    (b'{"items": ["1001"', 400, "body: not valid JSON"),
    (b'{"k": 3}', 400, "field 'items': missing"),
    (b'{"items": "1001"}', 400, "field 'items': expected a list"),
    (b'{"items": [["1001"]]}', 400, "field 'items'[0]: expected a string or integer"),
    (b'{"items": ["1001"], "k": 0}', 400, "field 'k': expected an integer in 1..20"),
    (b'{"items": ["1001"], "k": "5"}', 400, "field 'k'"),
    (b'{"items": ["1001"], "k": 21}', 400, "field 'k'"),
    (b'{"items": ["1001"], "exclude_seen": "yes"}', 400, "field 'exclude_seen'"),
    (b'{"items": ["1001"], "times": [1, 2]}', 400, "field 'times': 2 timestamps for 1 items"),
    (b'{"items": ["1001"], "item": []}', 400, "field 'item': unknown field"),
    (b'[{"items": ["1001"]}, {"items": ["1002"], "k": -1}]', 400, "body [1]: field 'k'"),
    (b"[]", 400, "body: an empty list"),
    (b'{"items": ["nope", "never"]}', 422, "field 'items': none of its 2 item ids is known"),
    (b'[{"items": ["1001"]}, {"items": ["nope"]}]', 422, "body [1]: field 'items'"),
    (b'{"items": ["1001"], "user": "' + b"x" * 5000 + b'"}', 413, "body: larger than the limit"),
]


@pytest.mark.parametrize(("body", "status", "error"), BAD, ids=[b[2][:30] for b in BAD])
def test_bad_requests_get_4xx_naming_the_field(served, body, status, error) -> None:
    server, _ = served
    got_status, got = request(server.port, "POST", "/recommend", raw=body)
    assert got_status == status, got
    assert isinstance(got, dict) and error in got["error"], got
    # the server keeps answering, and answers right
    assert request(server.port, "GET", "/health")[0] == 200
    ok, answer = request(server.port, "POST", "/recommend", {"items": ["1001"], "k": 1})
    assert ok == 200 and answer["items"] == ["1002"]


def test_info_and_health(served) -> None:
    server, rec = served
    assert request(server.port, "GET", "/health") == (200, "ok")
    status, info = request(server.port, "GET", "/info")
    assert status == 200
    assert info["model"] == "SASRec" and info["precision"] == "off"
    assert info["items"] == 20 and info["max_len"] == rec.max_len
    assert info["retrieval"] == "exact" and info["needs_times"] is False
    assert info["data_fingerprint"]["files"]  # the training data's digests


def test_start_up_fails_in_one_line(trained, tmp_path: Path, capsys) -> None:
    """Before anything listens (in this process: ``main`` returns before LitServe starts)."""
    from bft_lightning.serving import serve_cli

    none = tmp_path / "none.ckpt"
    assert serve_cli.main(["--ckpt_path", str(none), "--port", str(free_port())]) == 2
    assert capsys.readouterr().err == f"error: --ckpt_path checkpoint not found: {none}\n"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve_cli.main(["--ckpt_path", str(trained[0]), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: --port {port}: cannot listen on 127.0.0.1") and err.count("\n") == 1
    )
    assert serve_cli.main(["--ckpt_path", str(trained[0]), "--max-batch-size", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --max-batch-size must be an integer >= 1")


def test_without_the_extra_serve_names_the_install(monkeypatch, capsys) -> None:
    import importlib.util

    from bft_lightning.serving import serve_cli

    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "litserve" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert serve_cli.main(["--ckpt_path", "x.ckpt"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: litserve is not installed; the serve extra provides it: "
                   "pip install 'bft-lightning[serve]'")  # fmt: skip


def test_faiss_retrieval_from_a_checkpoint(trained, tmp_path: Path) -> None:
    """``retrieval="faiss"`` lists what exact lists on the small checkpoint; the index is
    saved beside the checkpoint and refused, naming it, once the items change; the
    ``recommend`` command takes ``--retrieval faiss``."""
    import shutil

    import torch

    from bft_lightning.retrieval.faiss_index import StaleIndexError
    from bft_lightning.serving.cli import main as recommend
    from bft_lightning.utils.checkpoint_io import (
        atomic_torch_save,
        content_digest,
        safe_load_checkpoint,
    )

    ckpt = tmp_path / "best.ckpt"
    shutil.copy(trained[0], ckpt)
    histories = [["1001", "1002"], ["1010"], [], ["1019", "1020", "1001"]]
    exact = Recommender.from_checkpoint(ckpt).recommend(histories, k=5, exclude_seen=True)
    fast = Recommender.from_checkpoint(ckpt, retrieval="faiss")
    assert (tmp_path / "best.ckpt.faiss").exists() and fast.retrieval == "faiss"
    for a, b in zip(exact, fast.recommend(histories, k=5, exclude_seen=True)):
        assert a.items == b.items and b.scores == pytest.approx(a.scores, abs=1e-5)
    source = tmp_path / "h.jsonl"
    source.write_text('{"user": "u", "items": ["1001"]}\n')
    args = ["--ckpt_path", str(ckpt), "--input", str(source), "--output", str(tmp_path / "o.csv")]
    assert recommend([*args, "--retrieval", "faiss", "--no-progress"]) == 0
    assert (tmp_path / "o.csv").read_text().splitlines()[1].startswith("u,1,1002,")
    state = safe_load_checkpoint(ckpt)
    with torch.no_grad():
        state["state_dict"]["model.item_emb.weight"][3] += 0.01
    atomic_torch_save(state, ckpt, digest=content_digest(state))
    with pytest.raises(StaleIndexError, match=r"best\.ckpt\.faiss: the index was built from"):
        Recommender.from_checkpoint(ckpt, retrieval="faiss")
