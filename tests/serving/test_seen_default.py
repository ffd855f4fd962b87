"""exclude_seen's default comes from the checkpoint's recorded repeat rate; an explicit
choice always wins, in the API, the recommend command and the server's /info."""

from __future__ import annotations

import pytest

from bft_lightning.retrieval.seen_default import (
    REPEAT_RATE_THRESHOLD,
    default_exclude_seen,
    resolve_exclude_seen,
)
from bft_lightning.serving import Recommender

HISTORY = [["1001", "1002", "1003"]]
SEEN = {"1001", "1002", "1003"}


def test_default_follows_the_repeat_rate():
    assert default_exclude_seen(0.0)[0] is True
    assert default_exclude_seen(REPEAT_RATE_THRESHOLD / 2)[0] is True
    assert default_exclude_seen(REPEAT_RATE_THRESHOLD)[0] is False
    assert default_exclude_seen(0.4)[0] is False
    keep, why = default_exclude_seen(None)
    assert keep is False and "does not record" in why
    assert "0.0% of the training targets" in default_exclude_seen(0.0)[1]
    assert resolve_exclude_seen(False, 0.0) == (False, "seen items kept: as asked")
    assert resolve_exclude_seen(True, 0.9)[0] is True


def test_checkpoint_records_its_repeat_rate_and_recommend_defaults_from_it(trained):
    ckpt, _, _ = trained
    rec = Recommender.from_checkpoint(ckpt)
    assert rec.repeat_rate == 0.0  # the cyclic users never repeat an item
    assert rec.exclude_seen_default[0] is True
    default = rec.recommend(HISTORY, k=17)[0]
    assert not set(default.items) & SEEN
    assert default.items == rec.recommend(HISTORY, k=17, exclude_seen=True)[0].items
    kept = rec.recommend(HISTORY, k=20, exclude_seen=False)[0]
    assert set(kept.items) >= SEEN  # an explicit choice wins
    rec.repeat_rate = 0.3  # data that repeats: seen items stay eligible by default
    assert set(rec.recommend(HISTORY, k=20)[0].items) >= SEEN
    with pytest.raises(ValueError, match="exclude_seen"):
        rec.recommend(HISTORY, exclude_seen="no")  # type: ignore[arg-type]


def test_recommend_command_says_which_default_applied(trained, tmp_path, capsys):
    from bft_lightning.serving.cli import main

    ckpt, _, _ = trained
    histories = tmp_path / "h.csv"
    histories.write_text("user,item\nu1,1001\nu1,1002\nu1,1003\n")
    out = tmp_path / "out.csv"
    assert main(["--ckpt_path", str(ckpt), "--input", str(histories), "--output", str(out),
                 "--k", "17", "--no-progress"]) == 0  # fmt: skip
    summary = capsys.readouterr().err
    assert "seen items excluded: 0.0% of the training targets" in summary
    rows = out.read_text().splitlines()[1:]
    assert not {r.split(",")[2] for r in rows} & SEEN
    assert main(["--ckpt_path", str(ckpt), "--input", str(histories), "--output", str(out),
                 "--k", "20", "--keep-seen", "--overwrite", "--no-progress"]) == 0  # fmt: skip
    assert "seen items kept: as asked" in capsys.readouterr().err
    assert {r.split(",")[2] for r in out.read_text().splitlines()[1:]} >= SEEN
