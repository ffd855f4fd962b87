"""bench/experiment_grid.py: the experiment files are the table's cells, and the composed
command builds the same run as a file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from bft_lightning.cli import BFTCLI

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "experiment_grid.py"
SPEC = importlib.util.spec_from_file_location("experiment_grid", SCRIPT)
assert SPEC is not None and SPEC.loader is not None
grid = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(grid)


def test_files_are_the_table() -> None:
    """Every cell of configs/grid.yaml is on disk as generated, and no generated file is
    left that the table no longer lists (run ``python bench/experiment_grid.py``)."""
    cells = grid.experiments()
    table = yaml.safe_load(grid.TABLE.read_text())
    assert len(cells) == len(table["backbones"]) * len(table["precisions"]) * len(table["datasets"])
    folder = ROOT / "configs" / "experiments"
    for name, text in cells.items():
        assert (folder / name).read_text() == text, f"{name} differs from configs/grid.yaml"
    generated = {p.name for p in folder.glob("*.yaml") if grid.GENERATED in p.read_text()}
    assert generated == set(cells)
    assert grid.main(["--check"]) == 0


def test_a_missing_part_is_named(tmp_path: Path) -> None:
    table = yaml.safe_load(grid.TABLE.read_text())
    table["datasets"] = ["no_such_data"]
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(table))
    for part in ("trainer", "model"):
        (tmp_path / part).mkdir()
        for f in (grid.TABLE.parent / part).glob("*.yaml"):
            (tmp_path / part / f.name).write_text(f.read_text())
    with pytest.raises(ValueError, match="data part configs/data/no_such_data.yaml"):
        grid.experiments(tmp_path / "grid.yaml")


def _copy_table(tmp_path: Path, table: dict) -> Path:
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(table))
    for part in ("trainer", "model", "data"):
        (tmp_path / part).mkdir()
        for f in (grid.TABLE.parent / part).glob("*.yaml"):
            (tmp_path / part / f.name).write_text(f.read_text())
    return tmp_path / "grid.yaml"


def test_model_for_gives_one_backbone_on_one_dataset_its_own_part(tmp_path: Path) -> None:
    table = yaml.safe_load(grid.TABLE.read_text())
    table["datasets"] = ["beauty", "sports"]
    table["trainer_for"] = {"sports": "cpu_small"}
    table["model_for"] = {"beauty": {"sasrec": "sasrec_{precision}_ce"}}
    cells = grid.experiments(_copy_table(tmp_path, table))
    for p in ("off", "on"):
        assert f"model: ../model/sasrec_{p}_ce.yaml" in cells[f"sasrec_{p}_beauty.yaml"]
        assert f"model: ../model/sasrec_{p}.yaml" in cells[f"sasrec_{p}_sports.yaml"]
        assert f"model: ../model/hstu_{p}.yaml" in cells[f"hstu_{p}_beauty.yaml"]
    assert "trainer: ../trainer/cpu_small.yaml" in cells["hstu_on_sports.yaml"]
    assert "trainer: ../trainer/cpu.yaml" in cells["hstu_on_beauty.yaml"]
    table["model_for"] = {"beauty": {"sasrec": "no_such_{precision}"}}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(table))
    with pytest.raises(ValueError, match="model part configs/model/no_such_off.yaml"):
        grid.experiments(tmp_path / "grid.yaml")
    table["model_for"] = {"beauty": {"sasrec": "sasrec_on"}}  # one part for both twins
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(table))
    with pytest.raises(ValueError, match="model_for beauty.sasrec = 'sasrec_on' names no"):
        grid.experiments(tmp_path / "grid.yaml")


class ParseOnly(BFTCLI):
    def instantiate_classes(self) -> None:
        pass


def _values(node: object) -> object:
    """The parsed values, without the file paths they were read from."""
    if isinstance(node, dict):
        return {k: _values(v) for k, v in node.items() if k not in ("__path__", "config")}
    if isinstance(node, list):
        return [_values(v) for v in node]
    return node


def _config(args: list[str]) -> object:
    cli = ParseOnly(subclass_mode_model=True, subclass_mode_data=True, args=args, run=False,
                    save_config_kwargs={"overwrite": True})  # fmt: skip
    return _values(cli.config.as_dict())


def test_composed_command_is_the_file() -> None:
    """``--seed_everything 0 --trainer T --model M --data D`` parses to the same config as
    ``--config configs/experiments/<cell>.yaml`` (the seed included)."""
    configs = ROOT / "configs"
    from_file = _config(["--config", str(configs / "experiments" / "hstu_on_beauty.yaml")])
    composed = _config([
        "--seed_everything", "0",
        "--trainer", str(configs / "trainer" / "cpu.yaml"),
        "--model", str(configs / "model" / "hstu_on.yaml"),
        "--data", str(configs / "data" / "beauty.yaml"),
    ])  # fmt: skip
    assert isinstance(from_file, dict) and from_file["seed_everything"] == 0
    assert composed == from_file
