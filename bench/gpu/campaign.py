"""The strong-baselines campaign's steps: which one is next, and what a GPU run packs.

``campaign.txt`` lists the steps in order (``dataset backbone noise [space]``); a step
is done when ``<results>/tuned/<name>.json`` (written by ``bench/tune_twins.py``) has
rows with every seed asked for. ``bench/gpu/campaign.sh`` asks for the next pending
step, runs it, and packs what the run wrote: the files under ``results/rec`` (study
databases and reports, tuned tables) and the retrainings' per-run summaries and ranks
under ``logs/tune_twins`` (not their checkpoints or TensorBoard logs), newer than a
marker file touched at the start.

    python bench/gpu/campaign.py next [--seeds 0 1 2]   # "dataset backbone noise space name"
    python bench/gpu/campaign.py status
    python bench/gpu/campaign.py pack --since MARKER --archive OUT/campaign.tar.gz
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sqlite3
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its common helpers
from common.tables import tuned_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CAMPAIGN = Path(os.environ.get("BFT_GPU_CAMPAIGN", Path(__file__).with_name("campaign.txt")))
RESULTS = ROOT / "results" / "rec"
RUNS = ROOT / "logs" / "tune_twins"
BACKBONES = ("sasrec", "bert4rec", "hstu")


@dataclass(frozen=True)
class Step:
    dataset: str
    backbone: str
    noise: float
    space: str

    @property
    def name(self) -> str:
        """``bench/tune_twins.py``'s ``setting_name``: the tuned table's file stem."""
        return tuned_name(self.dataset, self.backbone, self.space, self.noise)

    def args(self) -> list[str]:
        """The step's own options of ``bench/tune_twins.py``."""
        return ["--dataset", self.dataset, "--backbone", self.backbone,
                "--noise", f"{self.noise:g}", "--space", self.space]  # fmt: skip


def read_steps(path: Path) -> list[Step]:
    """The campaign file's steps; a bad line stops with its file and line number."""
    steps = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].split()
        if not line:
            continue
        where = f"{path}:{number}"
        if len(line) not in (3, 4):
            raise SystemExit(f"{where}: expected 'dataset backbone noise [space]', got {raw!r}")
        dataset, backbone, noise = line[:3]
        if backbone not in BACKBONES:
            raise SystemExit(f"{where}: backbone {backbone!r} is not one of {BACKBONES}")
        try:
            rate = float(noise)
        except ValueError:
            raise SystemExit(f"{where}: noise {noise!r} is not a number") from None
        if not 0.0 <= rate < 1.0:
            raise SystemExit(f"{where}: noise {rate} is not in [0, 1)")
        default = "sasrec_ss256" if backbone == "sasrec" else backbone
        space = line[3] if len(line) == 4 else default
        for kind, name in (("off", space), ("on", space)):
            if not (ROOT / "configs" / "search" / f"{name}_{kind}.yaml").is_file():
                raise SystemExit(f"{where}: no search space configs/search/{name}_{kind}.yaml")
        steps.append(Step(dataset, backbone, rate, space))
    return steps


def is_done(step: Step, seeds: list[int], results: Path = RESULTS) -> bool:
    """Whether the step's tuned table exists with rows over every seed in ``seeds``."""
    table = results / "tuned" / f"{step.name}.json"
    if not table.is_file():
        return False
    rows = json.loads(table.read_text()).get("summary_rows", [])
    return bool(rows) and all(set(seeds) <= set(r.get("seeds") or []) for r in rows)


def study_config(path: Path) -> str | None:
    """The ``--config`` a stored study was made with (its ``bft_tune`` record), if any."""
    if not path.is_file():
        return None
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        row = db.execute(
            "select value_json from study_user_attributes where key = 'bft_tune'"
        ).fetchone()
    args = json.loads(row[0]).get("fit_args", []) if row else []
    return args[args.index("--config") + 1] if "--config" in args else None


def started_elsewhere(step: Step, results: Path = RESULTS, root: Path = ROOT) -> bool:
    """Whether a twin's study of the step was made from another checkout: a stored
    study continues only with the same fit arguments (``tune`` refuses others), and
    they name the experiment config by its path, so such a step stays with the
    machine that started it."""
    space = "" if step.space == step.backbone else f"_{step.space}"
    for twin in ("off", "on"):
        db = results / "tune" / f"{step.dataset}_{step.backbone}{space}_{twin}.db"
        config = study_config(db)
        if config is not None and not config.startswith(str(root / "configs") + os.sep):
            return True
    return False


def next_pending(steps: list[Step], seeds: list[int], results: Path = RESULTS) -> Step | None:
    """The first step neither done nor started from another checkout, in the
    campaign's order; None when there is none."""
    return next(
        (s for s in steps if not is_done(s, seeds, results) and not started_elsewhere(s, results)),
        None,
    )


def _newer(root: Path, since: float) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file() and p.stat().st_mtime > since)


def pack(since: float, archive: Path, manifest: dict, results: Path = RESULTS,
         runs: Path = RUNS) -> list[str]:  # fmt: skip
    """One tar.gz of the files the run wrote: ``rec/`` (under ``results``, summary.json
    aside: the unpack rewrites it) and ``runs/`` (per-run summaries and arrays, without
    the trials' folders, checkpoints and TensorBoard logs). Returns the member names."""
    members = []
    for path in _newer(results, since):
        rel = path.relative_to(results)
        if rel != Path("summary.json"):
            members.append((path, f"rec/{rel.as_posix()}"))
    for path in _newer(runs, since):
        rel = path.relative_to(runs)
        if rel.parts[0] == "tune" or "tb" in rel.parts or path.suffix == ".ckpt":
            continue
        if path.name in ("running",):
            continue
        members.append((path, f"runs/{rel.as_posix()}"))
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path, name in members:
            tar.add(path, arcname=f"campaign/{name}")
        data = json.dumps(manifest | {"members": [n for _, n in members]}, indent=1).encode()
        info = tarfile.TarInfo("campaign/manifest.json")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return [n for _, n in members]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("action", choices=["next", "status", "pack"])
    p.add_argument("--campaign", type=Path, default=CAMPAIGN)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--runs", type=Path, default=RUNS)
    p.add_argument("--since", type=Path, help="pack: a marker file touched at the start")
    p.add_argument("--archive", type=Path, help="pack: the tar.gz to write")
    p.add_argument("--manifest", default="{}", help="pack: JSON recorded in the archive")
    args = p.parse_args()
    steps = read_steps(args.campaign)
    if args.action == "next":
        step = next_pending(steps, args.seeds, args.results)
        if step is not None:
            print(step.dataset, step.backbone, f"{step.noise:g}", step.space, step.name)
    elif args.action == "status":
        for s in steps:
            state = "done" if is_done(s, args.seeds, args.results) else "pending"
            if state == "pending" and started_elsewhere(s, args.results):
                state = "started elsewhere"
            print(f"{state:17} {s.name}")
    else:
        if args.since is None or args.archive is None:
            p.error("pack needs --since and --archive")
        names = pack(args.since.stat().st_mtime, args.archive, json.loads(args.manifest),
                     args.results, args.runs)  # fmt: skip
        size = args.archive.stat().st_size / 2**20
        print(f"packed {len(names)} files into {args.archive} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
