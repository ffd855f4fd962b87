"""A tiny study end to end: trials through fit, a pruned one, a refused one, best.yaml."""

from __future__ import annotations

import contextlib
import csv
import io
from pathlib import Path

import optuna
import pytest
import yaml
from tune_helpers import CONFIG, tiny, tune, write

from bft_lightning.cli import entry

LR = "model.init_args.lr"


@pytest.fixture(scope="module")
def study_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """3 trials of 2 epochs, in this order: a good lr, a hopeless one (pruned by the
    median of the first), a negative one (the model refuses it)."""
    tmp = tmp_path_factory.mktemp("tune")
    space = write(
        tmp / "space.yaml", f"{LR}: {{type: categorical, choices: [0.01, 1.0e-7, -1.0]}}\n"
    )
    storage = f"sqlite:///{tmp}/study.db"
    # the capture fixture is function-scoped: this module's study is captured by hand
    study = optuna.create_study(study_name="tiny", storage=storage, direction="maximize")
    for lr in (0.01, 1e-7, -1.0):
        study.enqueue_trial({LR: lr})
    args = ["--config", CONFIG, "--search", str(space), "--trials", "3", "--storage", storage,
            "--study-name", "tiny", "--out", str(tmp / "out"), *tiny(tmp)]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with pytest.raises(SystemExit) as stop:
            entry(["tune", *args])
    return {"tmp": tmp, "code": stop.value.code, "out": out.getvalue(), "err": err.getvalue(),
            "storage": storage, "args": args}  # fmt: skip


def _trials(run: dict) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="tiny", storage=run["storage"]).get_trials()


def test_study_runs_its_budget_and_prints_a_line_per_trial(study_run: dict) -> None:
    assert study_run["code"] in (0, None), study_run["err"]
    lines = [x for x in study_run["out"].splitlines() if x.startswith("trial ")]
    assert [x.split()[1:3] for x in lines] == [["0", "COMPLETE"], ["1", "PRUNED"], ["2", "FAIL"]]
    assert "lr=0.01" in lines[0] and lines[0].rstrip().endswith(" s")
    trials = _trials(study_run)
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "FAIL"]


def test_pruned_trial_stopped_after_its_first_validation(study_run: dict) -> None:
    good, bad, _ = _trials(study_run)
    assert sorted(bad.intermediate_values) == [0]  # epoch 0 only: pruned there
    assert bad.intermediate_values[0] < good.intermediate_values[0]
    assert len(good.intermediate_values) == 2


def test_refused_value_is_a_failed_trial_with_its_reason(study_run: dict) -> None:
    failed = _trials(study_run)[2]
    assert failed.user_attrs["fail_kind"] == "refused"
    assert "lr" in failed.user_attrs["fail_reason"]
    line = next(x for x in study_run["out"].splitlines() if x.startswith("trial   2"))
    assert line.endswith(failed.user_attrs["fail_reason"])


def test_trial_records_run_folder_checkpoint_epoch_and_value(study_run: dict) -> None:
    good = _trials(study_run)[0]
    attrs = good.user_attrs
    run_dir = Path(attrs["run_dir"])
    assert run_dir.name == "tiny_trial000" and (run_dir / "config.yaml").is_file()
    assert Path(attrs["best_ckpt"]).is_file() and Path(attrs["best_ckpt"]).parent.parent == run_dir
    assert good.value == pytest.approx(attrs["best_value"])
    assert good.value == pytest.approx(max(good.intermediate_values.values()))
    assert attrs["best_epoch"] == 1 + max(
        good.intermediate_values, key=good.intermediate_values.get
    )


def test_report_files_and_best_yaml_that_fit_trains(study_run: dict, capsys) -> None:
    out = study_run["tmp"] / "out"
    for name in ("best.yaml", "trials.md", "trials.csv", "history.png"):
        assert (out / name).is_file(), name
    assert "importances.png not drawn" in study_run["out"]  # one completed trial
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert [r["state"] for r in rows] == ["COMPLETE", "PRUNED", "FAIL"]
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best["model"]["init_args"]["lr"] == 0.01
    assert best["trainer"]["max_epochs"] == 2
    save = study_run["tmp"] / "refit"
    entry(
        ["fit", "--config", str(out / "best.yaml"), f"--trainer.logger.init_args.save_dir={save}"]
    )
    assert list(save.glob("quick/version_0/checkpoints/best.ckpt"))


def test_rerun_of_a_finished_study_only_reports(study_run: dict, capsys) -> None:
    code, out, _ = tune(study_run["args"], capsys)
    assert code == 0
    assert not [x for x in out.splitlines() if x.startswith("trial ")]
    assert "best: trial 0" in out
    assert len(_trials(study_run)) == 3


def test_rerun_with_another_space_is_refused(study_run: dict, capsys) -> None:
    args = list(study_run["args"])
    other = write(
        study_run["tmp"] / "other.yaml", f"{LR}: {{type: categorical, choices: [0.01]}}\n"
    )
    args[args.index("--search") + 1] = str(other)
    code, out, err = tune(args, capsys)
    assert code == 2 and "trial" not in out
    assert err.startswith("error: --study-name tiny: the stored study was made with another search")


def test_all_trials_refused_exits_2(tmp_path: Path, capsys) -> None:
    space = write(tmp_path / "space.yaml", f"{LR}: {{type: float, low: -2.0, high: -1.0}}\n")
    code, out, _ = tune(
        ["--config", CONFIG, "--search", str(space), "--trials", "1", "--storage",
         f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "out"), *tiny(tmp_path)],
        capsys,
    )  # fmt: skip
    assert code == 2
    assert "trial   0 FAIL" in out and "all 1 trials failed" in out
    assert not (tmp_path / "out" / "best.yaml").exists()


def test_a_study_keeps_the_fit_config_it_was_made_with(tmp_path: Path, capsys) -> None:
    """The config files change after a study: a finished one reports with the config its
    trials ran with; one with budget left refuses to go on, naming what changed."""
    from tune_helpers import REPO

    configs = REPO / "configs"
    model = write(tmp_path / "model.yaml", (configs / "model" / "sasrec_off.yaml").read_text())
    experiment = write(
        tmp_path / "experiment.yaml",
        f"seed_everything: 0\ntrainer: {configs / 'trainer' / 'cpu_quick.yaml'}\n"
        f"model: {model}\ndata: {configs / 'data' / 'synthetic.yaml'}\n",
    )
    space = write(tmp_path / "space.yaml", f"{LR}: {{type: categorical, choices: [0.01]}}\n")
    args = ["--config", str(experiment), "--search", str(space), "--trials", "1",
            "--storage", f"sqlite:///{tmp_path}/s.db", "--study-name", "kept",
            "--out", str(tmp_path / "out"), *tiny(tmp_path)]  # fmt: skip
    code, _, err = tune(args, capsys)
    assert code == 0, err

    def dropout() -> float:
        best = yaml.safe_load((tmp_path / "out" / "best.yaml").read_text())
        return best["model"]["init_args"]["backbone"]["init_args"]["dropout"]

    assert dropout() == 0.5
    assert "dropout: 0.5\n" in model.read_text()
    model.write_text(model.read_text().replace("dropout: 0.5\n", "dropout: 0.3\n"))
    code, out, err = tune(args, capsys)  # finished: it only reports
    assert code == 0, err
    assert not [x for x in out.splitlines() if x.startswith("trial ")]
    assert "model.init_args.backbone.init_args.dropout: 0.5 -> 0.3" in out
    assert "best.yaml keeps the config they ran with" in out
    assert dropout() == 0.5
    args[args.index("--trials") + 1] = "2"  # budget left: new trials would differ
    code, out, err = tune(args, capsys)
    assert code == 2 and not [x for x in out.splitlines() if x.startswith("trial ")]
    assert err.startswith("error: --study-name kept: the fit config has changed since")
    assert "model.init_args.backbone.init_args.dropout: 0.5 -> 0.3" in err
    assert len(err.strip().splitlines()) == 1
    model.write_text(model.read_text().replace("dropout: 0.3\n", "dropout: 0.5\n"))
    code, out, err = tune(args, capsys)  # restored: the study goes on
    assert code == 0, err
    assert [x.split()[1] for x in out.splitlines() if x.startswith("trial ")] == ["1"]


def test_config_changes_compare_values_not_text() -> None:
    from bft_lightning.tuning.study import fit_config_changes

    made = "# lightning.pytorch==2.5.0\ntrainer:\n  max_epochs: 3\nmodel:\n  lr: 0.001\n"
    # another header, another key order, the same values written otherwise: no change
    same = "# lightning.pytorch==2.6.6\nmodel:\n  lr: 1.0e-3\ntrainer:\n  max_epochs: 3\n"
    assert fit_config_changes(made, same) == []
    # an option added to the code since: the stored config, parsed again, has its default
    added = made + "  new_option: null\n"
    assert fit_config_changes(made, added, reparse=lambda t: t + "  new_option: null\n") == []
    # ... while an option only one side sets is a change (a callback, a scheduler)
    assert fit_config_changes(made, added) == ["model.new_option: (not set) -> null"]
    assert fit_config_changes(made, added, reparse=lambda t: 1 / 0) == [
        "model.new_option: (not set) -> null"
    ]  # a stored config the current parser refuses is compared as stored
    # the type is part of the value: 1.0 is every batch, 1 is one
    assert fit_config_changes(made, made.replace("max_epochs: 3", "max_epochs: 3.0")) == [
        "trainer.max_epochs: 3 -> 3.0"
    ]
    changed = "trainer:\n  max_epochs: 4\nmodel:\n  lr: 0.002\n"
    assert fit_config_changes(made, changed) == [
        "model.lr: 0.001 -> 0.002", "trainer.max_epochs: 3 -> 4",
    ]  # fmt: skip
    many = "".join(f"k{i}: {i}\n" for i in range(6))
    assert fit_config_changes(many, many.replace(": ", ": 1"))[-1] == "and 2 more"


def test_config_changes_see_added_callbacks_and_schedulers() -> None:
    """On real resolved dumps: a block added where there was none (a scheduler, a
    callback) is a change, as is a fraction of batches turned into a count; the same
    config resolved again is not."""
    from tune_helpers import REPO

    from bft_lightning.tuning.study import fit_config_changes
    from bft_lightning.tuning.trial import config_yaml

    base = ["--config", str(REPO / "configs/experiments/sasrec_off_synthetic.yaml"),
            "--trainer.limit_train_batches=1.0"]  # fmt: skip
    made = config_yaml(base)
    assert fit_config_changes(made, config_yaml(base)) == []
    batches = fit_config_changes(made, config_yaml([*base, "--trainer.limit_train_batches=1"]))
    assert batches == ["trainer.limit_train_batches: 1.0 -> 1"]
    scheduler = config_yaml([*base, "--lr_scheduler=StepLR", "--lr_scheduler.step_size=2"])
    assert any(c.startswith("lr_scheduler") for c in fit_config_changes(made, scheduler))
    monitor = config_yaml(
        [
            *base,
            "--trainer.callbacks+=LearningRateMonitor",
            "--trainer.callbacks.logging_interval=epoch",
        ]
    )
    assert any(c.startswith("trainer.callbacks.") for c in fit_config_changes(made, monitor))
