"""Write (or ``--check``) the grid of recommendation experiment configs from one table.

``configs/grid.yaml`` lists the backbones, precisions and datasets; every
combination is ``configs/experiments/<backbone>_<precision>_<dataset>.yaml``:
``seed_everything`` and the paths of its trainer, model and data parts
(``trainer_for`` gives a dataset its own trainer part, ``model_for`` one backbone on
a dataset its own model part). The files exist so that an experiment stays one
short command
(``python -m bft_lightning fit --config configs/experiments/sasrec_on_beauty.yaml``);
the same run composed by hand is
``python -m bft_lightning fit --seed_everything 0 --trainer configs/trainer/cpu.yaml
--model configs/model/sasrec_on.yaml --data configs/data/beauty.yaml``.

    python bench/experiment_grid.py          # write the files
    python bench/experiment_grid.py --check  # exit 1 if a file differs or is missing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "configs" / "grid.yaml"
GENERATED = "# generated from configs/grid.yaml by bench/experiment_grid.py: edit the table"


def _dataset_name(data_file: Path) -> str:
    """The ``dataset`` a data part names (for the file's title line)."""
    init = (yaml.safe_load(data_file.read_text(encoding="utf-8")) or {}).get("init_args") or {}
    return str(init.get("dataset", data_file.stem))


def experiments(table: Path = TABLE) -> dict[str, str]:
    """``{file name: text}`` of every cell of the grid; a part that is missing is named."""
    spec = yaml.safe_load(table.read_text(encoding="utf-8"))
    configs = table.parent
    out = {}
    for backbone, title in spec["backbones"].items():
        for precision in spec["precisions"]:
            for dataset in spec["datasets"]:
                trainer = (spec.get("trainer_for") or {}).get(dataset, spec["trainer"])
                model = ((spec.get("model_for") or {}).get(dataset) or {}).get(backbone)
                if model is not None and "{precision}" not in str(model):
                    raise ValueError(
                        f"{table}: model_for {dataset}.{backbone} = {model!r} names no "
                        "{precision}: the off and on twins would get the same model part"
                    )
                model = (model or f"{backbone}_{{precision}}").format(precision=precision)
                parts = {
                    "trainer": f"trainer/{trainer}.yaml",
                    "model": f"model/{model}.yaml",
                    "data": f"data/{dataset}.yaml",
                }
                for key, part in parts.items():
                    if not (configs / part).is_file():
                        raise ValueError(f"{table}: {key} part configs/{part} does not exist")
                name = f"{backbone}_{precision}_{dataset}.yaml"
                lines = [
                    f"# {title} precision={precision} on {_dataset_name(configs / parts['data'])}",
                    f"# python -m bft_lightning fit --config configs/experiments/{name}",
                    GENERATED,
                    f"seed_everything: {spec['seed_everything']}",
                    *(f"{key}: ../{part}" for key, part in parts.items()),
                ]
                out[name] = "\n".join(lines) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only, write nothing")
    args = parser.parse_args(argv)
    folder = ROOT / "configs" / "experiments"
    stale = []
    for name, text in experiments().items():
        path = folder / name
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text, encoding="utf-8")
    orphans = sorted(
        p.name for p in folder.glob("*.yaml")
        if GENERATED in p.read_text(encoding="utf-8") and p.name not in experiments()
    )  # fmt: skip
    if args.check and (stale or orphans):
        print(f"out of date with configs/grid.yaml: {stale + orphans}", file=sys.stderr)
        return 1
    for name in orphans:  # a cell taken out of the table
        (folder / name).unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
