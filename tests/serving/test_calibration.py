"""The calibrated confidence: a logistic map to P(hit@k), fit on held-out users."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from recdata import FIRST, NUM_ITEMS, config, successor

from bft_lightning import Recommender
from bft_lightning.retrieval import TopK
from bft_lightning.serving.confidence import plackett_luce_log_prob, softmax_mass
from bft_lightning.serving.hit_calibration import (
    ConfidenceCalibration,
    confidence_features,
    feature_names,
    fit_calibration,
)
from bft_lightning.utils.checkpoint_io import safe_load_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_fit_recovers_a_known_logistic_model() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40000, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5])
    logit = 1.5 * x[:, 0] - 0.5 * x[:, 1] + 0.0 * x[:, 2] - 1.0
    y = torch.bernoulli(torch.sigmoid(logit), generator=g)
    cal = fit_calibration(x, y, ("a", "b", "c"), k=10, l2=0.0)
    # weights on the standardised features = true weights x feature std
    w = torch.tensor(cal.weights, dtype=torch.float64)
    assert torch.allclose(w, torch.tensor([1.5, -1.0, 0.0], dtype=torch.float64), atol=0.06)
    p = cal.probability(x).double()
    # calibrated: within each decile of p the mean hit rate matches the mean p
    order = torch.argsort(p)
    for chunk in order.chunk(10):
        assert abs(float(p[chunk].mean() - y[chunk].mean())) < 0.03
    assert 0.7 < cal.auroc < 0.9 and cal.n_users == 40000


def test_fit_needs_both_outcomes() -> None:
    x = torch.randn(50, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="need users with and without a hit"):
        fit_calibration(x, torch.ones(50), ("a", "b"), k=10)


def test_round_trip_and_bad_fields() -> None:
    cal = ConfidenceCalibration(k=5, features=("a", "b"), mean=(0.0, 1.0), std=(1.0, 2.0),
                                weights=(0.5, -0.2), bias=0.1, n_users=10, hit_rate=0.3,
                                auroc=0.7)  # fmt: skip
    assert ConfidenceCalibration.from_dict(cal.to_dict()) == cal
    d = cal.to_dict()
    del d["weights"]
    with pytest.raises(ValueError, match="x.ckpt: confidence calibration lacks weights"):
        ConfidenceCalibration.from_dict(d, "x.ckpt")
    with pytest.raises(ValueError, match="std has 1 values for 2 features"):
        ConfidenceCalibration(k=5, features=("a", "b"), mean=(0.0, 0.0), std=(1.0,),
                              weights=(0.0, 0.0), bias=0.0, n_users=1, hit_rate=0.0,
                              auroc=0.5)  # fmt: skip
    with pytest.raises(ValueError, match="bias is NaN"):
        ConfidenceCalibration.from_dict(cal.to_dict() | {"bias": math.nan})


@pytest.mark.parametrize("precision", ["off", "on"])
def test_features_are_the_documented_signals(precision: str) -> None:
    from bft_lightning.models import SASRec
    from bft_lightning.nn.stats import set_recording

    torch.manual_seed(0)
    model = SASRec(30, 6, d_model=16, nhead=2, num_layers=1, dim_feedforward=32,
                   precision=precision).eval()  # fmt: skip
    ids = torch.tensor([[0, 0, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9]])
    set_recording(model, precision == "on")
    hidden, lp, scale = model.last_encoded(ids)
    scores = model.score(hidden, lp).float()
    lse = torch.logsumexp(scores[:, 1:], 1)
    v, i = torch.topk(scores[:, 1:], 6, dim=1)
    top = TopK(scores=v, ids=i + 1, logsumexp=lse)
    log_count = torch.log1p(torch.arange(31, dtype=torch.float32))
    x = confidence_features(model, lp, top, 5, torch.tensor([4, 6]), ids[:, -1], log_count, scale)
    assert x.shape == (2, len(feature_names(precision))) and x.dtype == torch.float64
    head = TopK(scores=v[:, :5], ids=i[:, :5] + 1, logsumexp=lse)
    m = softmax_mass(head).double()
    torch.testing.assert_close(x[:, 0], (m / (1 - m)).log(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x[:, 1], plackett_luce_log_prob(head).double())
    torch.testing.assert_close(x[:, 2], (v[:, 0] - v[:, 5]).double())
    torch.testing.assert_close(x[:, 3], torch.log1p(torch.tensor([4.0, 6.0])).double())
    torch.testing.assert_close(x[:, 4], torch.log1p(torch.tensor([6.0, 9.0])).double())
    assert torch.isfinite(x).all()
    set_recording(model, False)


def write_mixed(path: Path, users: int = 600, seed: int = 0) -> Path:
    """Half the users walk the item cycle (predictable), half pick items at random."""
    rng = random.Random(seed)
    lines = []
    for u in range(users):
        n = rng.randrange(6, 12)
        if u % 2 == 0:
            start = rng.randrange(NUM_ITEMS)
            items = [str(FIRST + (start + j) % NUM_ITEMS) for j in range(n)]
        else:
            items = [str(FIRST + rng.randrange(NUM_ITEMS)) for _ in range(n)]
        lines.append(" ".join([str(u + 1), *items]))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A BFT SASRec fit on ``write_mixed`` (the filter's features are in its confidence)."""
    from bft_lightning.cli import main

    root = tmp_path_factory.mktemp("mixed")
    data = write_mixed(root / "mixed.txt")
    cfg = config(root / "config.yaml", data, root, max_epochs=8, precision="on")
    main(["fit", "--config", str(cfg)])
    return root / "ckpt" / "best.ckpt", data, cfg


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bft_lightning", "calibrate", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _calibrate(capsys, *args: str) -> tuple[int, str]:
    """``calibrate`` in this process: (exit status, stderr)."""
    from bft_lightning.cli import build_datamodule
    from bft_lightning.serving.calibrate_cli import main

    code = main(list(args), build_data=build_datamodule)
    return code, capsys.readouterr().err


def test_calibrate_on_validation_users_then_recommend(mixed, tmp_path, capsys) -> None:
    ckpt, data, cfg = mixed
    out = tmp_path / "calibrated.ckpt"
    code, err = _calibrate(capsys, "--ckpt_path", str(ckpt), "--config", str(cfg), "--k", "3",
                           "--output", str(out))  # fmt: skip
    assert code == 0, err
    assert "calibrate: P(hit@3) fit on 600 users" in err
    assert "filter_z_margin, filter_log_precision" in err
    assert Recommender.from_checkpoint(ckpt).calibration is None  # --output: a copy
    state = safe_load_checkpoint(out)  # the digest was rewritten with the change
    assert state["bft_lightning"]["confidence"]["k"] == 3
    rec = Recommender.from_checkpoint(out)
    assert rec.calibration is not None and rec.describe()["confidence"].startswith("P(hit@3)")
    # fresh users of both kinds: the cyclic ones get a high probability and hit, the
    # random ones a low one; the mean probability matches the hit rate
    rng = random.Random(7)
    histories, targets = [], []
    for u in range(400):
        if u % 2 == 0:
            start = rng.randrange(NUM_ITEMS)
            h = [str(FIRST + (start + j) % NUM_ITEMS) for j in range(rng.randrange(5, 9))]
            nxt = successor(h[-1])
        else:
            h = [str(FIRST + rng.randrange(NUM_ITEMS)) for _ in range(rng.randrange(5, 9))]
            nxt = str(FIRST + rng.randrange(NUM_ITEMS))
        histories.append(h)
        targets.append(nxt)
    res = rec.recommend(histories, k=3)
    conf = torch.tensor([r.confidence for r in res])
    hit = torch.tensor([t in r.items for r, t in zip(res, targets, strict=True)]).double()
    assert ((conf >= 0) & (conf <= 1)).all()
    from bft_lightning.serving.hit_calibration import _auroc

    assert float(conf[0::2].mean()) > float(conf[1::2].mean()) + 0.1
    assert _auroc(conf.double(), hit) > 0.65
    assert abs(float(conf.mean()) - float(hit.mean())) < 0.1
    # a longer list keeps the calibrated P(hit@3) of its first 3 items
    res10 = rec.recommend(histories[:20], k=10)
    assert [r.confidence for r in res10] == pytest.approx([r.confidence for r in res[:20]],
                                                         abs=1e-6)  # fmt: skip
    assert [r.items[:3] for r in res10] == [r.items for r in res[:20]]


def test_calibrate_from_a_file_in_place(mixed, tmp_path, capsys) -> None:
    ckpt, _, _ = mixed
    copy = tmp_path / "model.ckpt"
    copy.write_bytes(ckpt.read_bytes())
    rng = random.Random(3)
    rows = []
    for u in range(300):
        start = rng.randrange(NUM_ITEMS)
        if u % 2:
            items = [str(FIRST + rng.randrange(NUM_ITEMS)) for _ in range(7)]
        else:
            items = [str(FIRST + (start + j) % NUM_ITEMS) for j in range(7)]
        rows.append({"user": f"u{u}", "items": items})
    rows.append({"user": "short", "items": ["1001"]})
    src = tmp_path / "held_out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = _calibrate(capsys, "--ckpt_path", str(copy), "--input", str(src), "--k", "3")
    assert code == 0, err
    assert "fit on 300 users (1 left out)" in err
    cal = Recommender.from_checkpoint(copy).calibration
    assert cal is not None and cal.k == 3 and cal.auroc > 0.7


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["--input", "missing.jsonl"], "missing.jsonl: input file not found"),
        (["--input", "x.jsonl", "--k", "20"], "--k 20: must be below the item count (20)"),
        (["--config", "nope.yaml"], "--config nope.yaml: file not found"),
    ],
)
def test_bad_input_exit_2(mixed, tmp_path, capsys, args, what) -> None:
    ckpt, _, _ = mixed
    code, err = _calibrate(capsys, "--ckpt_path", str(ckpt), *args)
    assert code == 2
    assert err.strip().splitlines()[-1] == f"error: {what}"


def test_module_exit_2_without_traceback(mixed) -> None:
    done = _run("--ckpt_path", str(mixed[0]), "--input", "missing.csv")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "error: missing.csv: input file not found"


def test_predict_gives_the_calibrated_confidence_of_recommend(mixed, tmp_path, capsys) -> None:
    """`predict` on a calibrated checkpoint: the same probabilities as the Recommender."""
    from bft_lightning.cli import main

    ckpt, data, cfg = mixed
    cal = tmp_path / "cal.ckpt"
    code, err = _calibrate(capsys, "--ckpt_path", str(ckpt), "--config", str(cfg), "--k", "3",
                           "--output", str(cal))  # fmt: skip
    assert code == 0, err
    out = tmp_path / "next.jsonl"
    main(["predict", "--config", str(cfg), "--ckpt_path", str(cal),
          "--trainer.callbacks+=bft_lightning.serving.RecommendationWriter",
          f"--trainer.callbacks.output={out}", "--trainer.callbacks.k=5"])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    got = {r["user"]: r["confidence"] for r in rows if r["rank"] == 1}
    users = [line.split() for line in data.read_text().splitlines()][:50]
    rec = Recommender.from_checkpoint(cal)
    want = rec.recommend([u[1:] for u in users], k=5)
    assert [got[u[0]] for u in users] == pytest.approx([w.confidence for w in want], abs=1e-5)
    assert all(0 < got[u[0]] < 1 for u in users)
