"""bench/common: the helpers the benchmark scripts share (paired statistics, run records,
the summary table, the LM pre-training loop, hardware notes)."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import hardware, paired, pretrain, runs, tables  # noqa: E402


def test_mean_se_is_the_mean_and_sd_over_root_n() -> None:
    x = [0.2, 0.5, 0.9, 0.4]
    mean, se = paired.mean_se(x)
    assert mean == pytest.approx(0.5)
    assert se == pytest.approx(np.std(x, ddof=1) / 2.0)
    assert math.isnan(paired.mean_se([0.3])[1])
    assert paired.mean_se([0.3], single=None) == (0.3, None)


def test_paired_is_the_difference_b_minus_a_and_its_se() -> None:
    rng = np.random.default_rng(0)
    a = rng.random(50)
    b = a + 0.1 + 0.01 * rng.standard_normal(50)
    d, se = paired.paired(a, b)
    diff = b - a
    assert d == pytest.approx(diff.mean())
    assert se == pytest.approx(math.sqrt(((diff - diff.mean()) ** 2).sum() / 49 / 50))
    # pairing removes the spread between users: far below the unpaired SE
    assert se < 0.1 * math.sqrt(a.var(ddof=1) / 50 + b.var(ddof=1) / 50)
    assert math.isnan(paired.paired(a[:1], b[:1])[1])


def test_hits_and_ndcg_of_zero_based_ranks() -> None:
    ranks = np.array([0, 3, 9, 10, 50])
    assert paired.hits(ranks).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert paired.ndcg(ranks).tolist() == pytest.approx(
        [1.0, 1 / math.log2(5), 1 / math.log2(11), 0, 0]
    )


def test_paired_runs_pairs_the_same_questions_under_the_same_seed() -> None:
    def run(method: str, seed: int, values: list[float], noise: float = 0.3) -> dict:
        per_q = {f"q{i}": v for i, v in enumerate(values)}
        return {"method": method, "noise_rate": noise, "distractors": 0, "seed": seed,
                "per_question": per_q}  # fmt: skip

    records = [run("off", 0, [1, 0, 1]), run("bft", 0, [1, 1, 1]), run("off", 1, [0, 0, 1]),
               run("bft", 1, [1, 0, 0]), run("bft", 2, [0, 0, 0]),  # seed 2: no reference
               run("off", 0, [0, 0, 0], noise=0.0)]  # fmt: skip
    values = lambda r: r["per_question"]  # noqa: E731
    d, se, n = paired.paired_runs(records, "bft", "off", 0.3, 0, values)
    diffs = [0, 1, 0, 1, 0, -1]
    assert n == 6
    assert d == pytest.approx(np.mean(diffs))
    assert se == pytest.approx(np.std(diffs, ddof=1) / math.sqrt(6))
    assert paired.paired_runs(records, "focal", "off", 0.3, 0, values, empty=None) == (
        None,
        None,
        0,
    )


def test_run_records_round_trip_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "runs"
    for name in ("b", "a"):
        got = runs.save_run(folder / f"{name}.json", {"name": name, "em": 0.5})
        assert got == {"name": name, "em": 0.5}
    assert runs.read_runs(folder) == [{"name": "a", "em": 0.5}, {"name": "b", "em": 0.5}]
    assert runs.read_runs(tmp_path / "none") == []


def test_summary_rows_from_a_table_and_a_tuned_pair(tmp_path: Path) -> None:
    row = {"dataset": "beauty", "backbone": "sasrec", "tag": "", "variant": "on_frequency",
           "seeds": [0, 1], "hr10": 0.06, "paired_delta_hr10": 0.002, "paired_se_hr10": 0.001,
           "commands": ["reproduce_rec.py --override=--model.mask_history=true"]}  # fmt: skip
    (tmp_path / "beauty_sasrec.json").write_text(json.dumps([row]))
    tuned = tables.summary_row(row, tag="tuned/x", variant="on", tuned=True, trials=4)
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "x.json").write_text(json.dumps({"summary_rows": [tuned]}))
    tables.write_summary(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["tag"] for r in summary] == ["", "tuned/x"]
    first = summary[0]
    assert list(first)[: len(tables.SUMMARY_KEYS)] == list(tables.SUMMARY_KEYS)
    assert first["paired_delta_hr10"] == 0.002 and first["ndcg10"] is None
    assert (first["tuned"], first["noise"], first["protocol"]) == (False, 0.0, "seen_masked")
    assert summary[1]["variant"] == "on" and summary[1]["trials"] == 4


def test_tuned_name_names_the_space_only_when_it_is_not_the_backbones() -> None:
    assert tables.tuned_name("beauty", "sasrec", "sasrec", 0.0) == "beauty_sasrec"
    assert tables.tuned_name("beauty", "sasrec", "ss256", 0.3) == "beauty_sasrec_ss256_noise30"


def test_hardware_notes() -> None:
    assert hardware.threads() == f"{torch.get_num_threads()} threads"
    assert hardware.device_name("cpu") is None
    assert hardware.cpu_note().endswith(f", {os.cpu_count()} cores")
    assert hardware.cpu_name() == hardware.cpu_note().rsplit(", ", 1)[0]
    assert 0.0 < hardware.peak_rss_gib() < 1024.0
    if platform.system() == "Linux":
        assert len(hardware.load_averages().split()) == 3
        assert hardware.load_average() >= 0.0


def test_pretrain_lowers_the_loss_and_runs_once(tmp_path: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Data(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(256, 4, generator=g)
            return DataLoader(TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])),
                              batch_size=16)  # fmt: skip

    built = []

    def build() -> tuple[Tiny, Data]:
        built.append(1)
        return Tiny(), Data()

    def record(fit: pretrain.Fit) -> dict:
        return {"trace": fit.trace, "seconds": fit.seconds, "steps": fit.trainer.global_step}

    done = tmp_path / "pretrain.json"
    out = pretrain.pretrain(done, tmp_path, 40, build, record, every=10, limit_val_batches=0)
    assert out["steps"] == 40 and len(out["trace"]) == 4
    assert out["trace"][-1] < 0.1 * out["trace"][0]
    assert json.loads(done.read_text()) == out
    assert pretrain.pretrain(done, tmp_path, 40, build, record) == out and built == [1]
