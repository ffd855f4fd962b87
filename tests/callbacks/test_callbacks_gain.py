"""Gain by item stratum and by context length, on scripted statistics with known answers."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from toy_bft import FAST, LazyToy, RankBatches, ScriptedModule, ToyBFT, loader, make_batches

from bft_lightning.callbacks import GainByContextLength, GainByStratum

pytestmark = pytest.mark.filterwarnings("ignore:.*(val_dataloader|LeafSpec|logging interval).*")

FREQ = torch.arange(9.0)  # items 1..8 seen 1..8 times: quartiles {1,2} {3,4} {5,6} {7,8}


def by_item(ids):
    """K = id / 10, log lambda = -id, n_eff = position among valid positions."""
    f = ids.float().unsqueeze(-1)
    pos = (ids > 0).long().cumsum(1).float().unsqueeze(-1)
    return {"gain": f.expand(-1, -1, 2) / 10, "log_prec": -f.expand(-1, -1, 2),
            "n_eff": pos.expand(-1, -1, 2)}  # fmt: skip


def data(n=3):
    return make_batches(n, length=8, vocab=9)


def expected_by_stratum(batches, key):
    k = [[] for _ in range(4)]
    for b in batches:
        ids = b[key] if b[key].ndim == 2 else b[key][:, None].expand_as(b["input_ids"])
        for i, valid in zip(ids.flatten().tolist(), (b["input_ids"] > 0).flatten().tolist()):
            if valid:
                k[(i - 1) // 2].append(i / 10)
    return [sum(v) / len(v) if v else math.nan for v in k]


def trainer(tmp_path, callback):
    return Trainer(callbacks=[callback], **{**FAST, "default_root_dir": str(tmp_path)})


def test_stratum_means_and_report_files_from_the_datamodule(tmp_path):
    batches = data()
    dm = RankBatches(batches, batches, item_frequency=FREQ)
    cb = GainByStratum()
    trainer(tmp_path, cb).validate(ScriptedModule(by_item), datamodule=dm)
    got = cb.last_means["K"][0].tolist()
    assert got == pytest.approx(expected_by_stratum(batches, "input_ids"))
    assert cb.last_means["log_prec"][0].tolist() == pytest.approx([-10 * v for v in got])
    assert cb.last_means["count"].sum() == sum(int((b["input_ids"] > 0).sum()) for b in batches)
    assert cb.last_summary["stratum_val/blocks.0/K/Q0"] == pytest.approx(got[0])
    md = (tmp_path / "gain_by_stratum_val.md").read_text()
    assert "### Mean Kalman gain K" in md and f"{got[3]:.4f}" in md
    assert (tmp_path / "gain_by_stratum_val.png").read_bytes()[:4] == b"\x89PNG"
    table = json.loads((tmp_path / "gain_by_stratum_val.json").read_text())
    assert table["layers"] == ["blocks.0"] and table["strata"] == ["Q0", "Q1", "Q2", "Q3"]
    assert table["K"][0] == pytest.approx(got)
    assert sum(table["count"][0]) == float(cb.last_means["count"].sum())


def test_reproduce_runner_reads_the_gain_table_as_json_and_as_markdown(tmp_path):
    """bench/reproduce_rec.py takes the per-layer K from the JSON, and from the
    Markdown tables of runs written before the JSON existed: both agree."""
    batches = data()
    logs = tmp_path / "logs"
    trainer(logs, GainByStratum()).validate(
        ScriptedModule(by_item), datamodule=RankBatches(batches, batches, item_frequency=FREQ)
    )
    spec = importlib.util.spec_from_file_location(
        "reproduce_rec", Path(__file__).parents[2] / "bench" / "reproduce_rec.py"
    )
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    for kind in ("json", "md"):  # a test run's files, and the names of older runs
        for name, stem in (("new", "gain_by_stratum_test"), ("old", "gain_by_stratum")):
            run = tmp_path / f"{name}_{kind}" / "tb" / "version_0"
            run.mkdir(parents=True)
            (run / f"{stem}.{kind}").write_text((logs / f"gain_by_stratum_val.{kind}").read_text())
    from_json = runner.layer_gains(tmp_path / "new_json")
    assert list(from_json) == ["blocks.0"]
    assert from_json["blocks.0"] == pytest.approx(expected_by_stratum(batches, "input_ids"))
    assert runner.layer_gains(tmp_path / "old_json") == from_json
    for name in ("new_md", "old_md"):
        from_md = runner.layer_gains(tmp_path / name)
        assert from_md["blocks.0"] == pytest.approx(from_json["blocks.0"], abs=5e-5)
    assert runner.layer_gains(tmp_path / "none") == {}


def test_stratum_of_the_target_from_a_constructor_frequency(tmp_path):
    batches = data()
    for b in batches:
        b["target"] = b["target"] % 8 + 1
    cb = GainByStratum(item_frequency=FREQ.tolist(), item_key="target", filename=None)
    trainer(tmp_path, cb).test(ScriptedModule(by_item), loader(batches))
    # K is the INPUT item's id / 10, grouped by the TARGET's stratum
    k = [[] for _ in range(4)]
    for b in batches:
        for row, tgt in zip(b["input_ids"].tolist(), b["target"].tolist()):
            k[(tgt - 1) // 2] += [i / 10 for i in row if i > 0]
    want = [sum(v) / len(v) if v else math.nan for v in k]
    assert cb.last_means["K"][0].tolist() == pytest.approx(want, nan_ok=True)
    assert "stratum_test/blocks.0/K/Q1" in cb.last_summary
    assert not list(tmp_path.glob("gain_by_stratum*"))


def test_stratum_without_frequency_or_key_warns(tmp_path):
    with pytest.warns(UserWarning, match="no item frequency"):
        trainer(tmp_path, GainByStratum()).validate(ScriptedModule(by_item), loader(data(1)))
    assert not list(tmp_path.glob("gain_by_stratum*"))
    cb = GainByStratum(item_frequency=FREQ.tolist(), item_key="items")
    with pytest.warns(UserWarning, match="no key 'items'"):
        trainer(tmp_path, cb).validate(ScriptedModule(by_item), loader(data(1)))


def by_position(ids):
    """n_eff = position, K = log(position) / 10: K tracks log n_eff exactly; constant gate."""
    pos = (ids > 0).long().cumsum(1).float().unsqueeze(-1)
    return {"gain": pos.clamp_min(1).log().expand(-1, -1, 2) / 10, "n_eff": pos.expand(-1, -1, 2),
            "gate": torch.full((*ids.shape, 4), 0.3)}  # fmt: skip


def test_gain_by_context_buckets_and_correlation(tmp_path):
    batches = data()
    cb = GainByContextLength(bucket_edges=[1, 2, 4])
    trainer(tmp_path, cb).validate(ScriptedModule(by_position), loader(batches))
    pos = torch.cat([(b["input_ids"] > 0).long().cumsum(1)[b["input_ids"] > 0] for b in batches])
    for j, (lo, hi) in enumerate([(1, 2), (2, 4), (4, 99)]):
        sel = pos[(pos >= lo) & (pos < hi)].double()
        assert cb.last_means["K"][0, j].item() == pytest.approx(sel.log().mean().item() / 10)
        assert cb.last_means["n_eff"][0, j].item() == pytest.approx(sel.mean().item())
        assert cb.last_means["gate"][0, j].item() == pytest.approx(0.3)
    assert cb.last_corr["K"][0].item() == pytest.approx(1.0)
    assert math.isnan(cb.last_corr["gate"][0].item())  # a constant gate tracks nothing
    assert cb.last_summary["gain_ctx_val/blocks.0/K/ctx2"] == cb.last_means["K"][0, 1].item()
    md = (tmp_path / "gain_by_context_val.md").read_text()
    assert "| blocks.0 | 0.0000 |" in md and "4+" in md
    assert "| blocks.0 | 1.000 | nan |" in md  # undefined (constant gate), not empty
    assert (tmp_path / "gain_by_context_val.png").exists()


def test_gain_by_context_on_the_gated_baseline(tmp_path):
    cb = GainByContextLength(by="length", filename=None)
    trainer(tmp_path, cb).validate(ToyBFT(precision="off", gate="sigmoid"), loader(data(2)))
    count = cb.last_means["count"][0]
    seen = count > 0
    assert torch.allclose(cb.last_means["K"][0][seen], torch.ones(int(seen.sum())).double())
    gate = cb.last_means["gate"][0][seen]
    assert ((gate > 0) & (gate < 1)).all()
    assert (cb.last_means["n_eff"][0][seen] >= 1).all()  # from the recorded attention
    assert math.isnan(cb.last_corr["K"][0].item())  # K = 1 everywhere
    assert -1 <= cb.last_corr["gate"][0].item() <= 1


def test_stratum_ids_align_with_trimmed_left_padding():
    """A model that drops all-padding columns on the left still gets its ids aligned."""
    from types import SimpleNamespace

    cb = GainByStratum(item_frequency=FREQ.tolist())
    ids = torch.tensor([[0, 0, 3, 4, 5], [0, 0, 0, 7, 8]])
    stats = SimpleNamespace(valid=torch.ones(2, 3, dtype=torch.bool))
    assert torch.equal(cb._item_ids({"input_ids": ids}, stats), ids[:, 2:])
    # a column that is not padding cannot have been trimmed: skipped with a warning
    stats = SimpleNamespace(valid=torch.ones(2, 2, dtype=torch.bool))
    with pytest.warns(UserWarning, match="positions"):
        assert cb._item_ids({"input_ids": ids}, stats) is None


def test_eval_callbacks_find_layers_built_in_configure_model(tmp_path):
    cb = GainByContextLength(bucket_edges=[1, 4], stages=["validate", "test"], filename=None)
    t = trainer(tmp_path, cb)
    t.validate(LazyToy(), loader(data(1)))
    assert cb.layer_names == ["encoder.layers.0", "encoder.layers.1"]
    assert cb.last_means["K"].shape[0] == 2 and "gain_ctx_val/encoder.layers.1/K/ctx1" in (
        cb.last_summary
    )
    t.test(LazyToy(), loader(data(1)))
    assert "gain_ctx_test/encoder.layers.1/K/ctx1" in cb.last_summary


def test_validation_and_test_reports_keep_separate_files(tmp_path):
    """``test`` after validation in the same log_dir must not overwrite the validation report."""
    batches = data()
    ctx = GainByContextLength(bucket_edges=[1, 4])
    strata = GainByStratum(item_frequency=FREQ.tolist())
    t = Trainer(callbacks=[ctx, strata], **{**FAST, "default_root_dir": str(tmp_path)})
    t.validate(ScriptedModule(by_item), loader(batches))
    t.test(ScriptedModule(by_item), loader(batches[:1]))
    for stem in ("gain_by_context", "gain_by_stratum"):
        assert "_val, step" in (tmp_path / f"{stem}_val.md").read_text().splitlines()[0]
        assert "_test, step" in (tmp_path / f"{stem}_test.md").read_text().splitlines()[0]
        assert (tmp_path / f"{stem}_val.png").exists() and (tmp_path / f"{stem}_test.png").exists()
    assert (
        json.loads((tmp_path / "gain_by_stratum_val.json").read_text())["prefix"] == "stratum_val"
    )
    assert json.loads((tmp_path / "gain_by_stratum_test.json").read_text())["prefix"] == (
        "stratum_test"
    )


def with_non_finite(ids):
    """``by_item`` with K NaN where the id is 3 and n_eff infinite where it is 8 (one of two)."""
    out = by_item(ids)
    gain, n_eff = out["gain"].clone(), out["n_eff"].clone()
    gain[..., 0][ids == 3] = math.nan
    n_eff[..., 1][ids == 8] = math.inf
    return {**out, "gain": gain, "n_eff": n_eff}


def test_non_finite_positions_are_left_out_and_counted(tmp_path):
    """One NaN K or infinite n_eff must not turn its whole bucket / stratum and the layer's
    correlation into NaN (dropped by loggers, shown like an empty bucket): those positions
    are left out of the means and counted under ``.../nonfinite``."""
    batches = data()
    ids = torch.cat([b["input_ids"].flatten() for b in batches])
    bad = int(((ids == 3) | (ids == 8)).sum())
    assert bad > 0
    ctx = GainByContextLength(bucket_edges=[1, 4])
    strata = GainByStratum(item_frequency=FREQ.tolist())
    t = Trainer(callbacks=[ctx, strata], **{**FAST, "default_root_dir": str(tmp_path)})
    t.validate(ScriptedModule(with_non_finite), loader(batches))

    good = ids[(ids > 0) & (ids != 3) & (ids != 8)]
    assert strata.last_summary["stratum_val/blocks.0/nonfinite"] == bad
    assert ctx.last_summary["gain_ctx_val/blocks.0/nonfinite"] == bad
    assert strata.last_means["count"].sum() == good.numel()
    assert ctx.last_means["count"].sum() == good.numel()
    want = [good[(good - 1) // 2 == j].double().mean().item() / 10 for j in range(4)]
    assert strata.last_means["K"][0].tolist() == pytest.approx(want)
    for summary in (strata.last_summary, ctx.last_summary):
        assert all(math.isfinite(v) for k, v in summary.items() if "gate" not in k)
    assert math.isfinite(ctx.last_corr["K"][0].item())
    table = json.loads((tmp_path / "gain_by_stratum_val.json").read_text())
    assert table["nonfinite"] == [bad] and None not in table["K"][0]
    for stem in ("gain_by_context_val", "gain_by_stratum_val"):
        md = (tmp_path / f"{stem}.md").read_text()
        k_table = md.split("### Mean Kalman gain K")[1].split("###")[0]
        assert "-" not in k_table.split("|---")[-1] and "nan" not in k_table
        assert f"| blocks.0 | {bad} |" in md  # the positions left out
