"""bench/findings_plot.py: the research verdict's picture, read from the result files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "findings_plot.py"
_spec = importlib.util.spec_from_file_location("findings_plot", SCRIPT)
assert _spec is not None and _spec.loader is not None
fp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fp)

ROW = {
    "dataset": "beauty", "backbone": "sasrec", "tag": "", "variant": "on_x", "seeds": [0, 1],
    "hr10": 0.07, "ndcg10": 0.04,
    "paired_delta_hr10": 0.003, "paired_se_hr10": 0.001,
    "paired_delta_ndcg10": -0.001, "paired_se_ndcg10": 0.0004,
    "paired_delta_hr10_q0": 0.0001, "paired_se_hr10_q0": 0.002,
    "paired_delta_hr10_cold": 0.004, "paired_se_hr10_cold": 0.0015,
}  # fmt: skip


def test_reads_a_summary_row_and_draws(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    off = {k: ROW[k] for k in ("dataset", "backbone", "tag", "seeds", "hr10", "ndcg10")}
    summary.write_text(json.dumps([dict(off, variant="off"), ROW]))
    label, vals = fp.load("x=beauty:sasrec::on_x", json.loads(summary.read_text()))
    assert label == "x"
    assert vals["hr10"] == (0.003, 0.001) and vals["hr10_cold"] == (0.004, 0.0015)
    out = tmp_path / "f.png"
    assert (
        fp.main(
            ["--summary", str(summary), "--out", str(out), "--comparisons", "x=beauty:sasrec::on_x"]
        )
        == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp.png"))  # written whole, then moved


def test_missing_or_bad_comparisons_name_themselves() -> None:
    rows = [dict(ROW, variant="off", paired_delta_hr10=None)]
    rows[0] = {k: v for k, v in rows[0].items() if not k.startswith("paired")}
    with pytest.raises(KeyError, match="'x'.*beauty:sasrec::on_y.*summary.json"):
        fp.load("x=beauty:sasrec::on_y", rows)
    with pytest.raises(ValueError, match="no paired deltas"):
        fp.load("x=beauty:sasrec::off", rows)
    with pytest.raises(ValueError, match="LABEL=SOURCE"):
        fp.load("beauty:sasrec::off", rows)
    with pytest.raises(ValueError, match="dataset:backbone:tag:variant"):
        fp.load("x=beauty:sasrec", rows)
    with pytest.raises(FileNotFoundError, match="no_such_table"):
        fp.load("x=selected/no_such_table", rows)


def test_the_shipped_picture_reads_the_shipped_results() -> None:
    """Every comparison FINDINGS.md plots has its row in results/rec (no stale label)."""
    rows = json.loads((fp.REC / "summary.json").read_text())
    for spec in fp.DEFAULT + fp.TUNED:
        _, vals = fp.load(spec, rows)
        assert set(vals) == {key for key, _ in fp.PANELS}


def test_verdict_is_two_paired_se() -> None:
    assert fp.verdict(0.0021, 0.001) == "ahead"
    assert fp.verdict(-0.0021, 0.001) == "behind"
    assert fp.verdict(0.0019, 0.001) == "level" and fp.verdict(-0.0019, 0.001) == "level"
    assert fp.verdict(0.0, 0.0) == "level"


def test_selected_comparisons_are_read_beside_the_summary(tmp_path: Path) -> None:
    (tmp_path / "selected").mkdir()
    comp = {f"delta_{key}": [0.001, 0.0004] for key, _ in fp.PANELS}
    (tmp_path / "selected" / "x.json").write_text(json.dumps({"comparison": comp}))
    _, vals = fp.load("sel=selected/x", [], tmp_path)
    assert vals == {key: (0.001, 0.0004) for key, _ in fp.PANELS}


def test_a_row_kept_under_both_conventions_reads_the_published_one_by_default() -> None:
    masked = dict(ROW, protocol="seen_masked")
    kept = dict(ROW, protocol="unmasked", paired_delta_hr10=-0.002)
    for rows in ([kept, masked], [masked, kept]):
        assert fp.load("x=beauty:sasrec::on_x", rows)[1]["hr10"] == (0.003, 0.001)
        assert fp.load("x=beauty:sasrec::on_x:unmasked", rows)[1]["hr10"] == (-0.002, 0.001)
    with pytest.raises(KeyError, match="on_x:unmasked"):
        fp.load("x=beauty:sasrec::on_x:unmasked", [masked])
