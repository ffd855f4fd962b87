"""The search-space file: its format, ``extends``, conditions, and located errors."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from tune_helpers import CONFIG, REPO, tune, write

from bft_lightning.tuning.space import SearchSpaceError, load_space, to_override

SEARCH = REPO / "configs" / "search"


@pytest.mark.parametrize("backbone", ["sasrec", "bert4rec", "hstu"])
def test_on_space_extends_the_off_space(backbone: str) -> None:
    """Every off parameter is in the on space with the same distribution, plus BFT's own."""
    off = load_space(SEARCH / f"{backbone}_off.yaml")
    on = load_space(SEARCH / f"{backbone}_on.yaml")
    off_specs = {p.key: p.spec() for p in off.params}
    on_specs = {p.key: p.spec() for p in on.params}
    assert set(off_specs) < set(on_specs)
    assert all(on_specs[k] == v for k, v in off_specs.items())
    extra = {k.rsplit(".", 1)[-1] for k in set(on_specs) - set(off_specs)}
    assert {"prior_scale", "q_init", "prior_init"} <= extra
    assert [p.key for p in on.params][: len(off.params)] == [p.key for p in off.params]


def test_conditional_parameter_only_when_its_condition_holds() -> None:
    space = load_space(SEARCH / "sasrec_off.yaml")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = {"ce": 0, "sampled_softmax_logq": 0}
    for _ in range(30):
        values = space.sample(study.ask())
        loss = values["model.init_args.loss"]
        seen[loss] += 1
        assert ("model.init_args.num_negatives" in values) == (loss == "sampled_softmax_logq")
        assert 1e-4 <= values["model.init_args.lr"] <= 1e-2
    assert all(seen.values())  # both branches drawn


def test_overrides_are_fit_options() -> None:
    assert to_override("model.init_args.lr", 0.003) == "--model.init_args.lr=0.003"
    assert to_override("model.init_args.loss", "ce") == "--model.init_args.loss=ce"
    assert to_override("a.init_args.b", None) == '--config={"a": {"init_args": {"b": null}}}'


def test_child_key_replaces_the_inherited_one(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "a.lr: {type: float, low: 0.1, high: 0.2}\nb.x: 3\n")
    child = write(
        tmp_path / "child.yaml",
        "extends: base.yaml\na.lr: {type: float, low: 0.3, high: 0.4}\n"
        "c.y: {type: int, low: 1, high: 2}\n",
    )
    space = load_space(child)
    assert [p.key for p in space.params] == ["a.lr", "b.x", "c.y"]
    assert (space.params[0].low, space.params[0].line) == (0.3, 2)


BROKEN = {
    "bad_yaml": ("model.init_args.lr: {type: float, low: 0.1\n", r"line 2, column 1: invalid YAML"),
    "unknown_type": (
        "model.init_args.lr: {type: gaussian, low: 0.1, high: 1}\n",
        r"line 1: model.init_args.lr: type must be one of float, int, categorical, fixed",
    ),
    "low_above_high": (
        "x.y: 1\nmodel.init_args.lr: {type: float, low: 0.1, high: 0.01}\n",
        r"line 2: model.init_args.lr: low \(0.1\) is above high \(0.01\)",
    ),
    "unknown_field": (
        "model.init_args.lr: {type: float, low: 0.1, high: 1, lg: true}\n",
        r"line 1: model.init_args.lr: unknown field\(s\) lg for type float",
    ),
    "bad_when_key": (
        "model.init_args.lr: {type: float, low: 0.1, high: 1}\n"
        "model.init_args.num_negatives:\n"
        "  {type: int, low: 8, high: 64, when: {model.init_args.los: bce}}\n",
        r"line 2: model.init_args.num_negatives: when: model.init_args.los is not a parameter",
    ),
    "bad_when_value": (
        "model.init_args.loss: {type: categorical, choices: [ce, bce]}\n"
        "model.init_args.num_negatives:\n"
        "  {type: int, low: 8, high: 64, when: {model.init_args.loss: bpr}}\n",
        r"line 2: model.init_args.num_negatives: when: model.init_args.loss never takes 'bpr'",
    ),
    "log_zero": (
        "model.init_args.weight_decay: {type: float, low: 0.0, high: 0.1, log: true}\n",
        r"line 1: model.init_args.weight_decay: log needs low > 0",
    ),
    "duplicate": (
        "model.init_args.lr: 0.1\nmodel.init_args.lr: {type: float, low: 0.1, high: 1}\n",
        r"line 2: model.init_args.lr: given twice \(first at line 1\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_space_is_a_located_error(case: str, tmp_path: Path) -> None:
    text, pattern = BROKEN[case]
    path = write(tmp_path / f"{case}.yaml", text)
    with pytest.raises(SearchSpaceError, match=rf"^{path}: {pattern}"):
        load_space(path)


def test_broken_space_exits_2_without_traceback(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "space.yaml", BROKEN["low_above_high"][0])
    code, _, err = tune(
        ["--config", CONFIG, "--search", str(path), "--storage", f"sqlite:///{tmp_path}/s.db"],
        capsys,
    )
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: {path}: line 2: model.init_args.lr: low (0.1) is above high (0.01)"
    ]
    assert "Traceback" not in err
    assert not (tmp_path / "s.db").exists()  # nothing was created


def test_unknown_option_is_an_error_before_any_trial(tmp_path: Path, capsys) -> None:
    path = write(
        tmp_path / "space.yaml",
        "model.init_args.lr: {type: float, low: 1.0e-3, high: 1.0e-2}\n"
        "model.init_args.backbone.init_args.dropuot: {type: float, low: 0.0, high: 0.5}\n",
    )
    code, out, err = tune(
        ["--config", CONFIG, "--search", str(path), "--storage", f"sqlite:///{tmp_path}/s.db"],
        capsys,
    )
    assert code == 2 and "Traceback" not in err
    assert err.startswith(
        f"error: {path}: line 2: model.init_args.backbone.init_args.dropuot: the fit command "
        "line refuses it: not an option of the model or data"
    )
    assert "trial" not in out and not (tmp_path / "s.db").exists()


def test_missing_extra_says_which_pip_install(monkeypatch, capsys) -> None:
    import sys

    from bft_lightning.tuning.cli import main

    monkeypatch.setitem(sys.modules, "optuna_integration", None)  # import fails
    assert main(["--config", CONFIG, "--search", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "error: tune needs optuna_integration: pip install 'bft-lightning[tune]'  "
        "(optuna, optuna-integration)"
    )
