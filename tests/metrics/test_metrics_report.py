"""Reports: three files written atomically, JSON round-trip, Markdown tables."""

import math

import pytest
import torch

from bft_lightning.metrics.ranking import RankingMetric
from bft_lightning.metrics.report import compare_table, read_metrics, write_report


def metrics_dict(seed: int, with_gain: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(40, 51, generator=g)
    target = torch.randint(1, 51, (40,), generator=g)
    freq = torch.randint(0, 20, (51,), generator=g)
    hist = torch.randint(1, 30, (40,), generator=g)
    gain = torch.rand(40, generator=g) if with_gain else None
    m = RankingMetric(40, item_frequency=freq)
    m.update(scores, target, torch.arange(40), hist, gain)
    return m.compute()


def test_write_report_files_and_round_trip(tmp_path):
    metrics = metrics_dict(0)
    metrics["item_q2/hr@10"] = math.nan  # as for an empty stratum
    paths = write_report(metrics, tmp_path / "eval", "BFT on synthetic")
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == [
        "metrics.json",
        "metrics.md",
        "strata.png",
    ]  # no temporary files left behind
    back = read_metrics(paths["json"])
    assert back.keys() == metrics.keys()
    assert all(back[k] == v or (math.isnan(back[k]) and math.isnan(v)) for k, v in metrics.items())
    assert "null" in paths["json"].read_text() and "NaN" not in paths["json"].read_text()
    md = paths["md"].read_text()
    assert md.startswith("# BFT on synthetic")
    header = md.splitlines()[2]
    for col in ("HR@1", "HR@20", "NDCG@5", "NDCG@20", "MRR", "n", "mean K"):
        assert f" {col} |" in header
    assert "NDCG@1 " not in header
    assert sum(line.startswith("| item Q") for line in md.splitlines()) == 4
    assert sum(line.startswith("| user B") for line in md.splitlines()) == 4
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_gain_or_strata(tmp_path):
    metrics = {k: v for k, v in metrics_dict(1, with_gain=False).items() if "/" not in k}
    paths = write_report(metrics, tmp_path, "plain")
    md = paths["md"].read_text()
    assert "mean K" not in md and "item Q0" not in md and "| overall |" in md
    write_report(metrics, tmp_path, "again")  # overwrite in place
    assert "# again" in paths["md"].read_text()


def test_compare_table_side_by_side():
    bft, off = metrics_dict(2), metrics_dict(3, with_gain=False)
    table = compare_table({"bft": bft, "off": off})
    lines = table.splitlines()
    assert lines[0] == "| metric | bft | off | off − bft |"
    row = next(line for line in lines if line.startswith("| hr@10 |"))
    assert row.endswith(f"{off['hr@10'] - bft['hr@10']:+.4f} |")
    assert any(line.startswith("| item_q0/hr@10 |") for line in lines)
    gain_row = next(line for line in lines if line.startswith("| gain |"))
    assert gain_row.endswith("| – | – |")  # missing in "off"
    assert lines[-1].startswith("| n | 40 | 40 |")
    with pytest.raises(ValueError):
        compare_table({"bft": bft})
