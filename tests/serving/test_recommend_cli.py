"""``python -m bft_lightning recommend``: files in, raw-id rows out, bad input named."""

from __future__ import annotations

import csv
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from recdata import successor

from bft_lightning import Recommender
from bft_lightning.serving import cli as rcli

REPO = Path(__file__).resolve().parents[2]


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "bft_lightning", "recommend", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".csv":
        with open(path, newline="") as fh:
            return list(csv.DictReader(fh))
    return [json.loads(line) for line in path.read_text().splitlines()]


HISTORIES = [
    {"user": "alice", "items": ["1003", "1004", "1005"]},
    {"user": "bob", "items": [1010, 1011, "unknown-item"]},
    {"user": "carol", "items": []},
]


def test_jsonl_to_csv_end_to_end(trained, tmp_path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", HISTORIES)
    out = tmp_path / "out.csv"
    done = run_module("--ckpt_path", str(trained[0]), "--input", str(src), "--output", str(out),
                      "--k", "4")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1 unknown item ids skipped in 1 histories; 1 cold users" in done.stderr
    rows = read_rows(out)
    assert list(rows[0]) == ["user", "rank", "item", "score", "confidence"]
    assert [r["user"] for r in rows] == ["alice"] * 4 + ["bob"] * 4 + ["carol"] * 4
    assert [int(r["rank"]) for r in rows] == [1, 2, 3, 4] * 3
    by_user = {u: [r for r in rows if r["user"] == u] for u in ("alice", "bob", "carol")}
    assert by_user["alice"][0]["item"] == successor(1005)
    assert by_user["bob"][0]["item"] == successor(1011)
    api = Recommender.from_checkpoint(trained[0]).recommend(
        [h["items"] for h in HISTORIES], k=4
    )  # fmt: skip
    for h, r in zip(HISTORIES, api):
        got = by_user[h["user"]]
        assert [x["item"] for x in got] == r.items
        assert [float(x["score"]) for x in got] == pytest.approx(r.scores, abs=1e-6)
        assert [float(x["confidence"]) for x in got] == pytest.approx([r.confidence] * 4)


def test_csv_with_timestamps_to_jsonl(trained, tmp_path) -> None:
    src = tmp_path / "in.csv"
    # alice's rows out of time order: sorted by timestamp, 1005 is her last item
    src.write_text("user,item,timestamp\nalice,1004,20\nalice,1005,30\nalice,1003,10\n"
                   "bob,1010,5\nbob,1011,6\n")  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert rcli.main(["--ckpt_path", str(trained[0]), "--input", str(src), "--output",
                      str(out), "--k", "3", "--no-progress"]) == 0  # fmt: skip
    rows = read_rows(out)
    expected = [("alice", 1), ("alice", 2), ("alice", 3), ("bob", 1), ("bob", 2), ("bob", 3)]
    assert [(r["user"], r["rank"]) for r in rows] == expected
    api = Recommender.from_checkpoint(trained[0]).recommend([["1003", "1004", "1005"]], k=3)[0]
    assert [r["item"] for r in rows[:3]] == api.items
    assert rows[0]["item"] == successor(1005) and rows[3]["item"] == successor(1011)


def test_headerless_csv_keeps_file_order(tmp_path) -> None:
    src = tmp_path / "in.csv"
    src.write_text("u1,1003\nu1,1004\n\nu2,1007\n")
    got = list(rcli.read_histories(src))
    assert [(h.user, h.items, h.line) for h in got] == [("u1", ["1003", "1004"], 1),
                                                        ("u2", ["1007"], 4)]  # fmt: skip


def test_streams_in_batches(trained, tmp_path, monkeypatch) -> None:
    rows = [{"user": f"u{i}", "items": ["1001", "1002"]} for i in range(10)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert inspect.isgenerator(rcli.read_histories(src))
    read, calls = [], []
    original_reader, original = rcli.read_histories, Recommender.recommend_encoded

    def counting_reader(*args, **kwargs):
        for h in original_reader(*args, **kwargs):
            read.append(h.user)
            yield h

    def spy(self, encoded, k, exclude_seen):
        calls.append((len(encoded), len(read)))  # histories read when the batch is ranked
        return original(self, encoded, k, exclude_seen)

    monkeypatch.setattr(rcli, "read_histories", counting_reader)
    monkeypatch.setattr(Recommender, "recommend_encoded", spy)
    out = tmp_path / "out.csv"
    assert rcli.main(["--ckpt_path", str(trained[0]), "--input", str(src), "--output", str(out),
                      "--k", "2", "--batch-size", "3", "--no-progress"]) == 0  # fmt: skip
    assert calls == [(3, 3), (3, 6), (3, 9), (1, 10)]  # never more than a batch ahead
    assert len(read_rows(out)) == 20


BAD_JSONL = [
    ('{"user": "a", "items": ["1001"]}\n{"user": "b", "items": [\n', 2, "not valid JSON"),
    ('{"user": "a"}\n', 1, "missing field 'items'"),
    ('{"user": "a", "items": "1001"}\n', 1, "field 'items': expected a list"),
    ('\n\n{"user": "a", "items": ["1001", 1.5]}\n', 3, r"field 'items'\[1\]: expected a string"),
    ('{"user": "", "items": ["1001"]}\n', 1, "field 'user': empty id"),
    ('[1, 2]\n', 1, "expected a JSON object"),
    ('{"user": "a", "items": ["1001"]}\n{"user": "b", "items": ["x", "y"]}\n', 2,
     r"user 'b': none of its 2 item ids is known to the checkpoint \('x', 'y'\)"),
]  # fmt: skip
BAD_CSV = [
    ("user,item\na,1001\nb,1002,7\n", 3, "expected 2 fields, got 3"),
    ("a,1001,10\na,1002,soon\n", 2, "timestamp: expected a number, got 'soon'"),
    ("a,1001\nb,1002\na,1003\n", 3, "user 'a' already had rows ending at line 1"),
    ("a,1001,1,2\n", 1, "expected 2 or 3 fields"),
    ("user,timestamp\na,1\n", 1, "lacks a 'user' or an 'item' column"),
    ("a,1001\nb,\n", 2, "item: empty id"),
]


@pytest.mark.parametrize("text, line, what", BAD_JSONL + BAD_CSV)
def test_bad_input_names_file_and_line(trained, tmp_path, capsys, text, line, what) -> None:
    suffix = ".csv" if (text, line, what) in BAD_CSV else ".jsonl"
    src = tmp_path / f"in{suffix}"
    src.write_text(text)
    out = tmp_path / "out.csv"
    out.write_text("previous output\n")
    code = rcli.main(["--ckpt_path", str(trained[0]), "--input", str(src), "--output", str(out),
                      "--no-progress", "--batch-size", "1", "--overwrite"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: {src}:{line}: "), err
    assert __import__("re").search(what, err[0]), err[0]
    assert out.read_text() == "previous output\n"  # untouched, no half-written file
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


@pytest.mark.parametrize(
    "args, what",
    [(["--k", "0"], "error: --k 0: k must be an integer in 1..20"),
     (["--k", "21"], "error: --k 21: k must be an integer in 1..20"),
     (["--ckpt_path", "missing.ckpt"], "error: --ckpt_path checkpoint not found: missing.ckpt"),
     (["--output", "out.txt"], "error: --output out.txt: cannot tell the output format"),
     (["--input", "in.txt"], "error: in.txt: cannot tell the input format"),
     (["--input", "nothere.jsonl"], "error: nothere.jsonl: input file not found")],
)  # fmt: skip
def test_bad_options_exit_2(trained, tmp_path, monkeypatch, capsys, args, what) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", HISTORIES)
    base = {"--ckpt_path": str(trained[0]), "--input": "in.jsonl", "--output": "out.csv"}
    opts = dict(base)
    opts.update(dict(zip(args[::2], args[1::2])))
    argv = [x for kv in opts.items() for x in kv] + ["--no-progress"]
    assert rcli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(what), err
    assert not (tmp_path / "out.csv").exists()


def test_module_exit_2_without_traceback(trained, tmp_path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"user": "a", "items": ["1001"]}\nnot json\n')
    out = tmp_path / "out.jsonl"
    done = run_module("--ckpt_path", str(trained[0]), "--input", str(src), "--output", str(out))
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {src}:2: not valid JSON (Expecting value)"
    assert not out.exists()
