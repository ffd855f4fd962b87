"""Run records, read and written in one place.

The language-model experiments keep one JSON per finished run in a folder
(``read_runs``, ``save_run``). A recommendation run of ``reproduce_rec.py`` is a
folder ``<runs>/<table>/<variant>_s<seed>/`` with its summary and per-user test
ranks; ``archive_run`` copies what a table needs of it to
``<results>/runs/<table>/<run>/`` (small enough to commit) and ``load_runs``
rebuilds the runs from either.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from bft_lightning.metrics.report import write_text_atomic

ROOT = Path(__file__).resolve().parents[2]
# per-user test ranks of a run, by evaluation convention: the user's seen items kept in
# the ranking, or excluded from it as the field's published tables do
RANK_FILES = {"unmasked": "ranks.npy", "seen_masked": "ranks_seen_masked.npy"}


# ------------------------------------------------------------- one JSON per run (LM)
def read_runs(folder: Path) -> list[dict]:
    """Every run record (``*.json``) in ``folder``, in the order of their names."""
    return [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))]


def save_run(file: Path, result: dict) -> dict:
    """Write a finished run's record (its folder made first); ``result`` back."""
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(result))
    return result


# ------------------------------------------------------ recommendation run folders
def run_arrays(out: Path) -> dict:
    """A run folder's test targets, training item counts and per-user history lengths
    (None for runs that did not save them)."""
    return {
        "targets": np.load(out / "targets.npy"),
        "item_frequency": np.load(out / "item_frequency.npy"),
        "history_len": np.load(out / "history_len.npy")
        if (out / "history_len.npy").exists() else None,
    }  # fmt: skip


def archive_run(out: Path, results_dir: Path) -> Path:
    """A finished run's results, small enough to commit: ``<results>/runs/<table>/<run>/``
    with its summary, per-user test ranks under each convention with the targets,
    history lengths and item counts (compressed), the layer gains and the resolved
    config. Run folders (checkpoints) do not survive a change of machine; these do,
    and :func:`load_runs` rebuilds every table from them."""
    dest = results_dir / "runs" / out.parent.name / out.name
    dest.mkdir(parents=True, exist_ok=True)
    arrays = {name.removesuffix(".npy"): np.load(out / name)
              for name in (*RANK_FILES.values(), "targets.npy", "history_len.npy",
                           "item_frequency.npy") if (out / name).exists()}  # fmt: skip
    np.savez_compressed(dest / "arrays.npz", **arrays)
    write_text_atomic(dest / "layer_gain.json", json.dumps(layer_gains(out)))
    for config in sorted(out.glob("tb/version_*/config.yaml"))[-1:]:  # repository-relative
        text = config.read_text().replace(f"{ROOT}/", "").replace(f"{ROOT.parent}/", "../")
        write_text_atomic(dest / "config.yaml", text)
    write_text_atomic(dest / "summary.json", (out / "summary.json").read_text())
    return dest


def _archived(dest: Path) -> dict:
    """One run as :func:`load_runs` returns it, from its :func:`archive_run` folder."""
    arrays = np.load(dest / "arrays.npz")
    summary = json.loads((dest / "summary.json").read_text())
    by_protocol = {p: arrays[n.removesuffix(".npy")] for p, n in RANK_FILES.items()
                   if n.removesuffix(".npy") in arrays and p in run_protocols(summary)}  # fmt: skip
    if "protocols" not in summary:
        by_protocol = {run_protocols(summary)[0]: arrays["ranks"]}
    return {
        "summary": summary, "ranks_by_protocol": by_protocol, "targets": arrays["targets"],
        "ranks": by_protocol.get("unmasked", next(iter(by_protocol.values()))),
        "item_frequency": arrays["item_frequency"],
        "history_len": arrays["history_len"] if "history_len" in arrays else None,
        "layer_gain": json.loads((dest / "layer_gain.json").read_text()),
    }  # fmt: skip


def load_runs(base: Path, variants: list[str], results_dir: Path | None = None) -> dict:
    """Every finished run under ``base`` (also those of other processes or earlier calls),
    and, with ``results_dir``, every run archived there (``archive_run``) whose folder is
    not here: a table is rebuilt from the committed results alone."""
    runs = {}
    if results_dir is not None:
        for done in sorted((results_dir / "runs" / base.name).glob("*_s*/summary.json")):
            variant, seed = done.parent.name.rsplit("_s", 1)
            if variant in variants and not (base / done.parent.name / "summary.json").exists():
                runs[(variant, int(seed))] = _archived(done.parent)
    for done in sorted(base.glob("*_s*/summary.json")):
        out = done.parent
        variant, seed = out.name.rsplit("_s", 1)
        if variant not in variants:
            continue
        summary = json.loads(done.read_text())
        by_protocol = {
            protocol: np.load(out / name)
            for protocol, name in RANK_FILES.items()
            if (out / name).exists() and protocol in run_protocols(summary)
        }
        if "protocols" not in summary:  # written before both were kept: one convention
            by_protocol = {run_protocols(summary)[0]: np.load(out / "ranks.npy")}
        runs[(variant, int(seed))] = {
            "summary": summary, "ranks_by_protocol": by_protocol,
            "ranks": by_protocol.get("unmasked", next(iter(by_protocol.values()))),
            **run_arrays(out), "layer_gain": layer_gains(out),
        }  # fmt: skip
    return runs


def run_protocols(summary: dict) -> list[str]:
    """The conventions a finished run kept ranks for. Runs from before both were kept
    hold one ``ranks.npy``: the seen-masked one if the run's overrides set
    ``mask_history=true``, else the unmasked one."""
    if "protocols" in summary:
        return list(summary["protocols"])
    override = " ".join((summary.get("settings") or {}).get("override", []))
    return ["seen_masked" if "mask_history=true" in override.lower() else "unmasked"]


def by_protocol(runs: dict) -> dict[str, dict]:
    """``{protocol: runs}`` with each run's ``ranks`` under that convention, for every
    convention that all the runs kept (seen-masked first: the published tables')."""
    common = set.intersection(*(set(r["ranks_by_protocol"]) for r in runs.values()))
    return {
        protocol: {key: {**r, "ranks": r["ranks_by_protocol"][protocol]} for key, r in runs.items()}
        for protocol in ("seen_masked", "unmasked")
        if protocol in common
    }


def layer_gains(out: Path) -> dict[str, list[float]]:
    """Mean Kalman gain per layer of the item tokens by their own popularity quartile
    (Q0..Q3) on test, from the run's ``gain_by_stratum_test.json`` (``GainByStratum``;
    runs written before the stage was in the name: ``gain_by_stratum.json``, and
    before that file existed: its ``.md`` tables); empty when the run has none
    (off twin, or no such callback)."""
    files = sorted(out.glob("tb/version_*/gain_by_stratum_test.json")) or sorted(
        out.glob("tb/version_*/gain_by_stratum.json")
    )
    if files:
        table = json.loads(files[-1].read_text())
        return {
            name: [math.nan if k is None else k for k in row]
            for name, row in zip(table["layers"], table["K"], strict=True)
        }
    files = sorted(out.glob("tb/version_*/gain_by_stratum_test.md")) or sorted(
        out.glob("tb/version_*/gain_by_stratum.md")
    )
    if not files:
        return {}
    gains, section = {}, False
    for line in files[-1].read_text().splitlines():
        if line.startswith("### "):
            section = line.startswith("### Mean Kalman gain")
        elif section and line.startswith("| ") and not line.startswith("| |"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            try:
                gains[cells[0]] = [float(c) for c in cells[1:5]]
            except ValueError:
                continue
    return gains
