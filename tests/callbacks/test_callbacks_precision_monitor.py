"""PrecisionMonitor on a user's own LightningModule: loggers, options, resuming."""

import csv
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tb_events import read_events
from toy_bft import FAST, LazyToy, ScriptedModule, ToyBFT, loader, make_batches

from bft_lightning.callbacks import PrecisionMonitor
from bft_lightning.callbacks.recording import select_layers

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*(val_dataloader|LeafSpec|logging interval|resuming from a checkpoint).*"
)

L0 = "encoder.layers.0"


def trainer(tmp_path, callbacks, logger=False, **kw):
    opts = {**FAST, "logger": logger, "default_root_dir": str(tmp_path), **kw}
    return Trainer(callbacks=callbacks, **opts)


def tb(tmp_path, name="tb"):
    return TensorBoardLogger(str(tmp_path), name=name, version=0)


class RecordSpy(Callback):
    """Placed before the monitor: sees whether recording is on at each batch end."""

    def __init__(self) -> None:
        self.on_steps: list[int] = []
        self.attention: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        layer = select_layers(pl_module, [0], "spy")[0][1]
        if layer.record:
            assert layer.last_stats is not None
            self.on_steps.append(trainer.global_step - 1)
            self.attention.append(layer.record_attention)


def test_tensorboard_histograms_and_scalars(tmp_path):
    seed_everything(0)
    batches = make_batches(5)
    model, monitor, spy = ToyBFT(), PrecisionMonitor(every_n_steps=2), RecordSpy()
    t = trainer(tmp_path, [spy, monitor], logger=tb(tmp_path), max_steps=5)
    t.fit(model, loader(batches))
    assert spy.on_steps == [0, 2, 4]  # recording only on the logged steps
    assert spy.attention == [False] * 3  # BFT layers give n_eff without holding the weights
    assert all(not layer.record and layer.last_stats is None for _, layer in monitor._layers)
    hists, scalars = read_events(t.log_dir)
    for q in ("log_prec", "log_prec_obs", "log_prec_post", "log_prec_out", "gain", "n_eff"):
        assert [s for s, _ in hists[f"bft/{L0}/{q}"]] == [0, 2, 4]
    # every valid position of the logged batch, once per group
    n_valid = int((batches[2]["input_ids"] > 0).sum())
    gain = dict(hists[f"bft/{L0}/gain"])[2]
    assert gain.num == sum(gain.bucket) == n_valid * 2
    assert 0.0 <= gain.min <= gain.max <= 1.0
    for tag in ("gain/mean", "gain/p10", "gain/p50", "gain/p90", "log_prec/mean", "q/g1"):
        assert [s for s, _ in scalars[f"bft/{L0}/{tag}"]] == [0, 2, 4]
    assert f"bft/{L0}/q" in hists
    p = {k: dict(scalars[f"bft/{L0}/gain/{k}"])[2] for k in ("p10", "p50", "p90")}
    assert p["p10"] <= p["p50"] <= p["p90"]


def test_csv_logger_gets_the_scalars_and_validation(tmp_path):
    seed_everything(0)
    monitor = PrecisionMonitor(every_n_steps=3, log_on_validation=True, val_max_batches=1)
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    t = trainer(tmp_path, [monitor], logger=logger, max_epochs=1)
    t.fit(ToyBFT(), loader(make_batches(4)), loader(make_batches(2, seed=50)))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    key, val_key = f"bft/{L0}/gain/p50", f"bft_val/{L0}/gain/mean"
    assert [int(r["step"]) for r in rows if r.get(key)] == [0, 3]
    assert [int(r["step"]) for r in rows if r.get(val_key)] == [4]
    # one validation batch of 4 sequences, every valid position per group
    assert monitor.last_histograms[f"bft_val/{L0}/gain"].num == 2 * int(
        (make_batches(2, seed=50)[0]["input_ids"] > 0).sum()
    )


def test_no_logger_warns_and_still_measures(tmp_path):
    monitor = PrecisionMonitor(every_n_steps=1)
    with pytest.warns(UserWarning, match="no logger"):
        trainer(tmp_path, [monitor], max_steps=2).fit(ToyBFT(), loader(make_batches(2)))
    assert monitor.num_logged == 2
    assert 0.0 < monitor.last_summary[f"bft/{L0}/gain/mean"] <= 1.0


def test_layer_quantity_range_and_bin_options(tmp_path):
    monitor = PrecisionMonitor(
        every_n_steps=1, layers=["*.1"], quantities=["gain", "q"], bins=10,
        ranges={"gain": (0.5, 1.0)}, percentiles={"gain": [25.0]},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path, [monitor], max_steps=1).fit(ToyBFT(), loader(make_batches(1)))
    L1 = "encoder.layers.1"
    assert set(monitor.last_histograms) == {f"bft/{L1}/gain", f"bft/{L1}/q"}
    h = monitor.last_histograms[f"bft/{L1}/gain"]
    assert h.counts.shape == (10,) and h.limits[0] == pytest.approx(0.55)
    assert set(monitor.last_summary) == {
        f"bft/{L1}/gain/mean", f"bft/{L1}/gain/p25", f"bft/{L1}/q/mean",
        f"bft/{L1}/q/g0", f"bft/{L1}/q/g1", f"bft/{L1}/gain/nonfinite", f"bft/{L1}/q/nonfinite",
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown quantities"):
        PrecisionMonitor(quantities=["lambda"])


def test_layers_without_bft_report_gain_one_and_n_eff(tmp_path):
    monitor = PrecisionMonitor(every_n_steps=1, quantities=["gain", "n_eff"], off_layer_n_eff=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path, [monitor], max_steps=1).fit(
            ToyBFT(precision="off"), loader(make_batches(1))
        )
    assert monitor.last_summary[f"bft/{L0}/gain/mean"] == 1.0
    assert monitor.last_histograms[f"bft/{L0}/n_eff"].min >= 1.0  # from the recorded weights


def test_resume_keeps_the_step_counters(tmp_path):
    seed_everything(0)
    batches = make_batches(8)
    first = PrecisionMonitor(every_n_steps=2)
    t = trainer(tmp_path, [first], logger=tb(tmp_path, "a"), max_steps=3)
    t.fit(ToyBFT(), loader(batches))
    assert (first.num_logged, first.last_step) == (2, 2)
    ckpt = str(tmp_path / "last.ckpt")
    t.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["callbacks"][first.state_key] == {
        "last_step": 2, "num_logged": 2,
    }  # fmt: skip

    second = PrecisionMonitor(every_n_steps=2)
    t2 = trainer(tmp_path, [second], logger=tb(tmp_path, "b"), max_steps=7)
    t2.fit(ToyBFT(), loader(batches), ckpt_path=ckpt)
    assert (second.num_logged, second.last_step) == (4, 6)
    hists, _ = read_events(t2.log_dir)
    assert [s for s, _ in hists[f"bft/{L0}/gain"]] == [4, 6]


def test_gradient_accumulation_logs_once_per_step(tmp_path):
    monitor, spy = PrecisionMonitor(every_n_steps=1), RecordSpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trainer(tmp_path, [spy, monitor], max_steps=2, accumulate_grad_batches=2)
        t.fit(ToyBFT(), loader(make_batches(4)))
    assert monitor.num_logged == 2 and monitor.last_step == 1


def test_layers_found_by_the_protocol_alone_on_validation(tmp_path):
    """A foreign layer that is no BFTEncoderLayer, only follows the recording protocol."""

    def script(ids):
        return {"gain": (ids.float() / 100).unsqueeze(-1).expand(-1, -1, 2)}

    batches = make_batches(2)
    monitor = PrecisionMonitor(log_on_validation=True, quantities=["gain"], bins=100)
    trainer(tmp_path, [monitor], logger=tb(tmp_path)).validate(
        ScriptedModule(script), loader(batches)
    )
    h = monitor.last_histograms["bft_val/blocks.0/gain"]
    ids = torch.cat([b["input_ids"][b["input_ids"] > 0] for b in batches]).double() / 100
    assert h.num == 2 * ids.numel() and h.max == pytest.approx(ids.max().item())
    assert h.mean == pytest.approx(ids.mean().item())
    hists, _ = read_events(f"{tmp_path}/tb/version_0")
    assert sum(dict(hists["bft_val/blocks.0/gain"])[0].bucket) == 2 * ids.numel()


def test_layers_built_in_configure_model_are_found(tmp_path):
    monitor = PrecisionMonitor(every_n_steps=1, log_on_validation=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [monitor], max_steps=2).fit(
            LazyToy(), loader(make_batches(2)), loader(make_batches(1, seed=7))
        )
    assert not [w for w in caught if "found no BFT layer" in str(w.message)]
    assert [name for name, _ in monitor._layers] == [L0, "encoder.layers.1"]
    assert monitor.num_logged == 3  # steps 0 and 1, and the validation epoch
    assert monitor.last_histograms[f"bft_val/{L0}/gain"].num > 0

    validate_only = PrecisionMonitor(log_on_validation=True)
    trainer(tmp_path, [validate_only]).validate(LazyToy(), loader(make_batches(1, seed=7)))
    assert validate_only.last_histograms[f"bft_val/{L0}/gain"].num > 0


def test_two_monitors_with_the_same_interval_share_a_trainer(tmp_path):
    gain = PrecisionMonitor(every_n_steps=1, quantities=["gain"])
    n_eff = PrecisionMonitor(every_n_steps=1, layers=[0], quantities=["n_eff"])
    assert gain.state_key != n_eff.state_key
    assert PrecisionMonitor().state_key == PrecisionMonitor().state_key  # a default one resumes
    t = trainer(tmp_path, [gain, n_eff], max_steps=1)
    t.fit(ToyBFT(), loader(make_batches(1)))
    assert gain.num_logged == n_eff.num_logged == 1
    assert {k.rsplit("/", 1)[0] for k in n_eff.last_summary} == {f"bft/{L0}/n_eff"}
    ckpt = str(tmp_path / "two.ckpt")
    t.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert saved[n_eff.state_key] == {"last_step": 0, "num_logged": 1}
    assert gain.state_key in saved


def test_two_monitors_writing_the_same_tags_are_refused(tmp_path):
    both = [PrecisionMonitor(every_n_steps=2), PrecisionMonitor(every_n_steps=3, layers=[-1])]
    with pytest.raises(ValueError, match="encoder.layers.1.*same prefix 'bft'"):
        trainer(tmp_path, both, max_steps=1).fit(ToyBFT(), loader(make_batches(1)))


@pytest.mark.parametrize("impl", ["sdpa", "chunked"])
def test_an_off_layer_with_a_fused_kernel_trains_identically_with_the_monitor(tmp_path, impl):
    def params(callbacks):
        seed_everything(0)
        model = ToyBFT(precision="off", attention_impl=impl)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer(tmp_path, callbacks, max_steps=3).fit(model, loader(make_batches(3)))
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    monitor = PrecisionMonitor(every_n_steps=1)
    assert torch.equal(params([]), params([monitor]))
    assert monitor.num_logged == 3
    assert not any("n_eff" in tag for tag in monitor.last_histograms)  # not measured: not logged
    asked = PrecisionMonitor(every_n_steps=1, off_layer_n_eff=True)
    params([asked])
    assert asked.last_histograms[f"bft/{L0}/n_eff"].min >= 1.0


def test_bad_percentiles_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"percentiles\['gain'\]: 150"):
        PrecisionMonitor(percentiles={"gain": [50, 150]})
    with pytest.raises(ValueError, match="key 'q'"):
        PrecisionMonitor(percentiles={"q": [50]})
    with pytest.raises(ValueError, match="key 'n_eff'"):
        PrecisionMonitor(quantities=["gain"], percentiles={"n_eff": [50]})
    assert PrecisionMonitor(quantities=["n_eff"]).percentiles == {}


def test_non_finite_values_are_counted_not_dropped(tmp_path):
    def script(ids):
        gain = (ids.float() / 100).unsqueeze(-1).expand(-1, -1, 2).clone()
        gain[ids % 3 == 0] = float("nan")
        gain[ids % 3 == 1, 0] = float("inf")
        return {"gain": gain}

    batches = make_batches(2)
    monitor = PrecisionMonitor(log_on_validation=True, quantities=["gain", "log_prec"])
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    trainer(tmp_path, [monitor], logger=logger).validate(ScriptedModule(script), loader(batches))
    ids = torch.cat([b["input_ids"][b["input_ids"] > 0] for b in batches])
    bad = 2 * int((ids % 3 == 0).sum()) + int((ids % 3 == 1).sum())
    assert 0 < bad < 2 * ids.numel()
    tag = "bft_val/blocks.0/gain"
    assert monitor.last_summary[f"{tag}/nonfinite"] == bad
    assert monitor.last_histograms[tag].num == 2 * ids.numel() - bad
    assert monitor.last_summary["bft_val/blocks.0/log_prec/nonfinite"] == 0
    with open(f"{logger.log_dir}/metrics.csv") as f:
        assert [float(r[f"{tag}/nonfinite"]) for r in csv.DictReader(f)] == [bad]
