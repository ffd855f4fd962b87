"""A trial's checks: divergence ends it, the monitor is the config's, seeds differ."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
from tune_helpers import CONFIG, tune, write

from bft_lightning.tuning.study import make_sampler
from bft_lightning.tuning.trial import _TrialRecorder, plan_study


def _trainer(**metrics: float) -> SimpleNamespace:
    return SimpleNamespace(
        current_epoch=3, global_step=40, sanity_checking=False,
        callback_metrics={k.replace("_", "/"): torch.tensor(v) for k, v in metrics.items()},
    )  # fmt: skip


def test_non_finite_training_loss_is_a_divergence() -> None:
    recorder = _TrialRecorder("val/ndcg@10")
    recorder.on_train_batch_end(_trainer(), None, {"loss": torch.tensor(1.5)}, None, 0)
    with pytest.raises(FloatingPointError, match=r"^diverged: training loss nan at epoch 3"):
        recorder.on_train_batch_end(_trainer(), None, {"loss": torch.tensor(float("nan"))}, None, 0)
    with pytest.raises(FloatingPointError, match="inf"):
        recorder.on_train_batch_end(_trainer(), None, torch.tensor(float("inf")), None, 0)


def test_validations_are_recorded_by_epoch_from_1_and_nan_metric_diverges() -> None:
    recorder = _TrialRecorder("val/ndcg@10")
    module = SimpleNamespace(current_epoch=1)
    recorder.on_validation_end(_trainer(), module)  # no metric logged: nothing recorded
    trainer = SimpleNamespace(
        sanity_checking=False, callback_metrics={"val/ndcg@10": torch.tensor(0.25)}
    )
    recorder.on_validation_end(trainer, module)
    assert recorder.values == [(2, 0.25)]
    trainer.callback_metrics["val/ndcg@10"] = torch.tensor(float("nan"))
    with pytest.raises(FloatingPointError, match=r"diverged: val/ndcg@10 = nan"):
        recorder.on_validation_end(trainer, module)


def test_monitor_and_mode_come_from_the_config() -> None:
    plan = plan_study(["--config", CONFIG], None)
    assert (plan.monitor, plan.mode, plan.save_dir, plan.versioned) == (
        "val/ndcg@10", "max", "logs", True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"--monitor val/hr@10: the config's ModelCheckpoint"):
        plan_study(["--config", CONFIG], "val/hr@10")
    with pytest.raises(ValueError, match=r"max_epochs=1 ends every trial before its first valid"):
        plan_study(["--config", CONFIG, "--trainer.max_epochs=1"], None)  # validates every 2


def test_a_monitor_other_than_the_checkpoints_exits_2(tmp_path: Path, capsys) -> None:
    space = write(
        tmp_path / "s.yaml", "model.init_args.lr: {type: float, low: 0.001, high: 0.01}\n"
    )
    code, _, err = tune(
        ["--config", CONFIG, "--search", str(space), "--monitor", "val/hr@10",
         "--storage", f"sqlite:///{tmp_path}/s.db"],
        capsys,
    )  # fmt: skip
    assert code == 2 and err.startswith("error: --monitor val/hr@10: the config's ModelCheckpoint")


def test_sampler_seed_depends_on_trial_count_and_worker_only() -> None:
    def first_draw(sampler: optuna.samplers.BaseSampler) -> float:
        study = optuna.create_study(sampler=sampler)
        return study.ask().suggest_float("x", 0.0, 1.0)

    same = first_draw(make_sampler(0, 5, 0)), first_draw(make_sampler(0, 5, 0))
    assert same[0] == same[1]
    others = {first_draw(make_sampler(0, n, w)) for n, w in [(0, 0), (1, 0), (0, 1), (5, 0)]}
    assert len(others) == 4 and same[0] in others


def test_twin_studies_draw_the_same_shared_values_in_their_first_trials() -> None:
    """With one sampler seed, trial n of the off and on studies (TPE's random start-up
    trials) takes the same values for every option the two spaces share."""
    from bft_lightning.tuning.space import load_space

    search = Path(__file__).resolve().parents[2] / "configs" / "search"
    draws = {}
    for twin in ("off", "on"):
        space = load_space(search / f"sasrec_{twin}.yaml")
        study = optuna.create_study(direction="maximize")
        draws[twin] = []
        for n in range(6):
            study.sampler = make_sampler(0, n, 0)
            trial = study.ask()
            draws[twin].append(space.sample(trial))
            study.tell(trial, float(n % 3))
    for off, on in zip(draws["off"], draws["on"], strict=True):
        assert {k: on[k] for k in off} == off
        assert set(on) - set(off)  # plus BFT's own options
    assert len({d["model.init_args.lr"] for d in draws["off"]}) == 6


@pytest.mark.parametrize(
    ("err", "kind", "reason"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
         "out_of_memory", "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"),
        (MemoryError(), "out_of_memory", "out of memory: MemoryError"),
        (FloatingPointError("diverged: loss nan"), "diverged", "diverged: loss nan"),
        (ValueError("dropout must be in [0, 1)"), "refused", "dropout must be in [0, 1)"),
        (SystemExit("NODE_RANK=3 but num_nodes=1"), "refused", "NODE_RANK=3 but num_nodes=1"),
        (RuntimeError("shape mismatch"), "error", "RuntimeError: shape mismatch"),
    ],
)  # fmt: skip
def test_failures_are_classified_with_a_one_line_reason(err, kind, reason) -> None:
    from bft_lightning.tuning.trial import _failure

    result = _failure(err)
    assert (result.state, result.kind, result.reason) == ("fail", kind, reason)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sasrec", "bert4rec", "hstu", "sasrec_ss256", "sasrec_ce"])
@pytest.mark.parametrize("twin", ["off", "on"])
def test_shipped_spaces_are_options_of_their_models(name: str, twin: str) -> None:
    """Every key of configs/search/<space>_<twin>.yaml, at each end and choice, parses."""
    from bft_lightning.tuning.space import load_space
    from bft_lightning.tuning.trial import check_keys

    repo = Path(__file__).resolve().parents[2]
    backbone = name.split("_")[0]
    space = load_space(repo / "configs" / "search" / f"{name}_{twin}.yaml")
    config = repo / "configs" / "experiments" / f"{backbone}_{twin}_synthetic.yaml"
    check_keys(plan_study(["--config", str(config)], None), space)


@pytest.mark.parametrize("name", ["median", "asha", "hyperband"])
def test_no_trial_is_pruned_before_prune_after(name: str) -> None:
    """A hopeless trial survives every epoch before ``prune_after`` and is pruned once
    there: a slow starter is judged when it has had the warm-up to show its pace."""
    from bft_lightning.tuning.study import make_pruner, prune_after_default

    study = optuna.create_study(
        direction="maximize", pruner=make_pruner(name, 8, 40, prune_after=6),
        sampler=optuna.samplers.RandomSampler(seed=0),
    )  # fmt: skip
    for _ in range(6):  # good trials that report (and ask) at every epoch
        trial = study.ask()
        for epoch in range(40):
            trial.report(1.0 + epoch, epoch)
            trial.should_prune()
        study.tell(trial, 41.0)
    slow = study.ask()
    pruned_at = None
    for epoch in range(40):
        slow.report(0.0, epoch)
        if slow.should_prune():
            pruned_at = epoch
            break
    if name == "hyperband":  # its bracket (by the study's name) may put the first rung late
        assert pruned_at is None or pruned_at >= 6
    else:
        assert pruned_at is not None and pruned_at >= 6
    assert prune_after_default(100) == 10 and prune_after_default(6) == 0
    assert prune_after_default(None) == 0


def test_negative_prune_after_is_refused() -> None:
    from bft_lightning.tuning.study import make_pruner

    with pytest.raises(ValueError, match="--prune-after"):
        make_pruner("median", 8, 40, prune_after=-1)


def test_first_signal_interrupts_a_second_is_ignored_and_handlers_come_back() -> None:
    import os
    import signal

    from bft_lightning.tuning.stopping import interrupt_seen, stop_signal, stops_on_signals

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with stops_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the signal arrives first
    assert stop_signal() == "SIGTERM"
    with stops_on_signals():
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert stop_signal() == "Ctrl+C"
        # not yet handled (a KeyboardInterrupt Python swallowed): raised again each second
        with pytest.raises(KeyboardInterrupt):
            time.sleep(5)
        interrupt_seen()  # handled: a second signal, as a parent passes it on, is ignored
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.5)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
