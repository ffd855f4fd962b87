"""Timestamps at serving time: HSTU trained with them is served with them (API, CLI,
``predict``), errors name the history or line, SASRec ignores them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from recdata import FIRST, NUM_ITEMS, config

from bft_lightning import Recommender
from bft_lightning.serving import cli as rcli
from bft_lightning.utils.checkpoint_format import save_checkpoint
from bft_lightning.utils.checkpoint_io import safe_load_checkpoint


def write_timed(path: Path, users: int = 200, seed: int = 0) -> dict[str, list[tuple[str, int]]]:
    """A RecBole atomic file of cyclic runs with timestamps whose gaps span seconds to
    weeks (so the time buckets vary); returns each user's (item, time), oldest first."""
    rng = random.Random(seed)
    log: dict[str, list[tuple[str, int]]] = {}
    lines = ["user_id:token\titem_id:token\ttimestamp:float"]
    for u in range(users):
        start, n, t = rng.randrange(NUM_ITEMS), rng.randrange(6, 14), 1_500_000_000
        rows = []
        for j in range(n):
            t += int(10 ** rng.uniform(0, 6))
            rows.append((str(FIRST + (start + j) % NUM_ITEMS), t))
        log[f"u{u}"] = rows
        lines += [f"u{u}\t{item}\t{ts}" for item, ts in rows]
    path.write_text("\n".join(lines) + "\n")
    return log


@pytest.fixture(scope="module")
def hstu(tmp_path_factory) -> tuple[Path, Path, dict[str, list[tuple[str, int]]]]:
    """(checkpoint, config, per-user log) of HSTU fit on timed data through the CLI."""
    from bft_lightning.cli import main

    root = tmp_path_factory.mktemp("timed")
    log = write_timed(root / "timed.inter")
    cfg = config(root / "config.yaml", root / "timed.inter", root, max_epochs=6)
    spec = yaml.safe_load(cfg.read_text())
    spec["model"]["init_args"]["backbone"] = {
        "class_path": "bft_lightning.models.HSTU",
        "init_args": {"d_model": 16, "nhead": 2, "num_layers": 2, "dropout": 0.0,
                      "precision": "on"},
    }  # fmt: skip
    cfg.write_text(yaml.safe_dump(spec))
    main(["fit", "--config", str(cfg)])
    ckpt = root / "ckpt" / "best.ckpt"
    with torch.no_grad():  # a visible time bias, so that dropping the times changes scores
        state = safe_load_checkpoint(ckpt)
        for name, value in state["state_dict"].items():
            if name.endswith("rab.time_weight"):
                value.copy_(torch.linspace(-1.0, 1.0, value.numel()))
        save_checkpoint(state, ckpt)  # sealed again, with a new digest
    return ckpt, cfg, log


def split(rows: list[tuple[str, int]]) -> tuple[list[str], list[int]]:
    return [i for i, _ in rows], [t for _, t in rows]


def test_checkpoint_records_timestamps(hstu, trained) -> None:
    assert safe_load_checkpoint(hstu[0])["bft_lightning"]["timestamps"] is True
    assert safe_load_checkpoint(trained[0])["bft_lightning"]["timestamps"] is False
    rec = Recommender.from_checkpoint(hstu[0])
    assert rec.needs_times and rec.describe()["timestamps"] == "required"
    sas = Recommender.from_checkpoint(trained[0])
    assert not sas.uses_times and not sas.needs_times


def test_api_with_times_equals_predict_step(hstu, tmp_path) -> None:
    """Each user's full history with its times through the API gives what ``predict``
    (the task's predict_step over the DataModule's batches) writes."""
    from bft_lightning.cli import main

    ckpt, cfg, log = hstu
    out = tmp_path / "next.jsonl"
    main(["predict", "--config", str(cfg), "--ckpt_path", str(ckpt),
          "--trainer.callbacks+=bft_lightning.serving.RecommendationWriter",
          f"--trainer.callbacks.output={out}", "--trainer.callbacks.k=5",
          "--trainer.callbacks.exclude_seen=false"])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    users = sorted(log)
    rec = Recommender.from_checkpoint(ckpt)
    items, times = zip(*(split(log[u]) for u in users), strict=True)
    # seen items kept on both sides (predict reads the input window, the API the history)
    api = rec.recommend(list(items), k=5, times=list(times), batch_size=64, exclude_seen=False)
    for user, r in zip(users, api, strict=True):
        got = [x for x in rows if x["user"] == user]
        assert [x["item"] for x in got] == r.items
        assert [x["score"] for x in got] == pytest.approx(r.scores, abs=1e-5)
        assert got[0]["confidence"] == pytest.approx(r.confidence, abs=1e-5)
    # the times matter: read without them (as an old checkpoint would allow) the scores move
    rec.trained_with_times = None
    blind = rec.recommend(list(items), k=5, batch_size=64, exclude_seen=False)
    assert any(b.scores != pytest.approx(r.scores, abs=1e-4) for b, r in zip(blind, api))


def test_missing_or_mismatched_times_name_the_history(hstu) -> None:
    rec = Recommender.from_checkpoint(hstu[0])
    items, times = split(hstu[2]["u0"])
    with pytest.raises(ValueError, match=r"history 1: no timestamps, but .*HSTU was trained"):
        rec.recommend([items, items], times=[times, None])
    with pytest.raises(ValueError, match=r"history 0: no timestamps"):
        rec.recommend([items])
    with pytest.raises(ValueError, match=rf"history 1: {len(times) - 1} times for {len(items)}"):
        rec.recommend([items, items], times=[times, times[:-1]])
    with pytest.raises(ValueError, match=r"history 0, time 2: expected a number"):
        rec.recommend([items], times=[[*times[:2], "soon", *times[3:]]])
    with pytest.raises(ValueError, match=r"1 lists of times for 2 histories"):
        rec.recommend([items, items], times=[times])
    assert rec.recommend([[]])[0].cold  # a cold user needs no times


def test_unknown_items_drop_their_times(hstu) -> None:
    rec = Recommender.from_checkpoint(hstu[0])
    items, times = split(hstu[2]["u3"])
    with_unknown = [*items[:2], "nope", *items[2:]]
    stamps = [*times[:2], times[2] - 1, *times[2:]]
    a = rec.recommend([items], k=4, times=[times])[0]
    b = rec.recommend([with_unknown], k=4, times=[stamps])[0]
    assert a.items == b.items and b.unknown == ("nope",)
    assert a.scores == pytest.approx(b.scores, abs=1e-6)


def test_cli_passes_jsonl_times_and_the_csv_timestamp_column(hstu, tmp_path) -> None:
    ckpt, _, log = hstu
    users = ["u1", "u2", "u5"]
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"user": u, "items": split(log[u])[0], "times": split(log[u])[1]}) + "\n"
            for u in users
        )
    )
    csv_src = tmp_path / "in.csv"  # rows in reverse time order: sorted by the column
    csv_src.write_text("user,item,timestamp\n" + "".join(
        f"{u},{i},{t}\n" for u in users for i, t in reversed(log[u])))  # fmt: skip
    rec = Recommender.from_checkpoint(ckpt)
    api = rec.recommend([split(log[u])[0] for u in users], k=3,
                        times=[split(log[u])[1] for u in users])  # fmt: skip
    for path in (src, csv_src):
        out = tmp_path / f"{path.stem}{path.suffix}.out.jsonl"
        args = ["--ckpt_path", str(ckpt), "--input", str(path), "--output", str(out), "--k", "3"]
        assert rcli.main([*args, "--no-progress"]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        for u, r in zip(users, api, strict=True):
            assert [x["item"] for x in rows if x["user"] == u] == r.items
            got = [x["score"] for x in rows if x["user"] == u]
            assert got == pytest.approx(r.scores, abs=1e-6)


@pytest.mark.parametrize(
    ("lines", "line", "what"),
    [
        ([{"user": "a", "items": ["1001", "1002"]}], 1, "no timestamps, but"),
        ([{"user": "a", "items": ["1001", "1002"], "times": [1, 2, 3]}], 1,
         "field 'times': 3 timestamps for 2 items"),
        ([{"user": "a", "items": ["1001"], "times": ["x"]}], 1, r"field 'times'\[0\]"),
        ([{"user": "a", "items": ["1001"], "times": [5]}, {"user": "b", "items": ["1002"]}], 2,
         "has no times, unlike the history on line 1"),
    ],
)  # fmt: skip
def test_cli_bad_times_name_file_and_line(hstu, tmp_path, capsys, lines, line, what) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out.csv"
    code = rcli.main(["--ckpt_path", str(hstu[0]), "--input", str(src), "--output", str(out),
                      "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f"{src}:{line}:" in err and not out.exists()
    assert __import__("re").search(what, err), err


def test_sasrec_ignores_times(trained) -> None:
    rec = Recommender.from_checkpoint(trained[0])
    histories = [["1003", "1004", "1005"], ["1010", "1011"]]
    plain = rec.recommend(histories, k=4)
    timed = rec.recommend(histories, k=4, times=[[30, 10, 20], [5, 6]])
    assert [r.items for r in plain] == [r.items for r in timed]
    assert [r.scores for r in plain] == [r.scores for r in timed]
    with pytest.raises(ValueError, match="history 1: 1 times for 2 items"):
        rec.recommend(histories, times=[[1, 2, 3], [1]])


def test_predict_refuses_data_without_the_timestamps_it_was_trained_with(hstu, tmp_path) -> None:
    from bft_lightning.cli import main

    ckpt, cfg, log = hstu
    untimed = tmp_path / "untimed.inter"  # the same interactions, no timestamp field
    untimed.write_text("user_id:token\titem_id:token\n" + "".join(
        f"{u}\t{i}\n" for u in sorted(log) for i, _ in log[u]))  # fmt: skip
    with pytest.raises(ValueError, match="trained with timestamps .* the data has none"):
        main(["predict", "--config", str(cfg), "--ckpt_path", str(ckpt),
              f"--data.init_args.path={untimed}"])  # fmt: skip


def test_calibrate_reads_the_times_of_its_input(hstu, tmp_path) -> None:
    """``calibrate --input`` with a ``times`` field: half the users walk the cycle, half
    are random (misses, so that there is something to calibrate)."""
    from bft_lightning.serving import calibrate_cli

    ckpt, _, log = hstu
    rng = random.Random(1)
    rows = []
    for n, u in enumerate(sorted(log)):
        items, times = split(log[u])
        if n % 2:
            items = [str(FIRST + rng.randrange(NUM_ITEMS)) for _ in items]
        rows.append({"user": u, "items": items, "times": times})
    src = tmp_path / "held_out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "calibrated.ckpt"
    code = calibrate_cli.main(["--ckpt_path", str(ckpt), "--input", str(src),
                               "--output", str(out), "--k", "5"])  # fmt: skip
    assert code == 0
    rec = Recommender.from_checkpoint(out)
    assert rec.calibration is not None and rec.needs_times
    got = rec.recommend([rows[0]["items"]], k=5, times=[rows[0]["times"]])[0]
    assert 0.0 <= got.confidence <= 1.0
    with pytest.raises(ValueError, match="trained with timestamps: calibrate it on histories"):
        rec.calibrate_encoded([[1, 2]], [3], k=5)
