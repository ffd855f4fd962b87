"""``results/rec/summary.json``, the one table over every comparison, and the names of
the tuned comparisons' tables (``results/rec/tuned/<name>.json``).

A row of the summary comes from a table of ``reproduce_rec.py`` (one fixed setting),
from a comparison of ``select_by_validation.py`` (``selected/*.json``) or from a pair
of tuned twins of ``tune_twins.py`` (``tuned/*.json``, rows made by ``summary_row``).
Light at import: ``bench/gpu/campaign.py`` names tables without torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUMMARY_KEYS = (
    "dataset", "backbone", "tag", "variant", "seeds", "hr10", "ndcg10", "paired_delta_hr10",
    "paired_se_hr10", "paired_delta_hr10_q0", "paired_se_hr10_q0", "paired_delta_ndcg10",
    "paired_se_ndcg10", "paired_delta_hr10_cold", "paired_se_hr10_cold",
)  # fmt: skip


def tuned_name(dataset: str, backbone: str, space: str, noise: float) -> str:
    """``<dataset>_<backbone>[_<space>][_noise<pct>]``: the space is named when it is not
    the backbone's own."""
    named = "" if space == backbone else f"_{space}"
    return f"{dataset}_{backbone}{named}" + (f"_noise{round(100 * noise)}" if noise else "")


def summary_row(row: dict, **fields: Any) -> dict:
    """A table row's ``SUMMARY_KEYS`` (None where it has none), then ``fields``."""
    out = {k: row.get(k) for k in SUMMARY_KEYS}
    out.update(fields)
    return out


def write_summary(res: Path) -> None:
    """``summary.json``: one row per (dataset, backbone, variant) over every table written.

    Every row says whether its setting was chosen on validation from a shared grid
    (``tuned``; the rows of ``selected/*.json``, written by ``select_by_validation.py``,
    are; a table's own rows, one fixed setting, are not), the share of training items
    replaced by random ones (``noise``), the metric the choice was made on
    (``chosen_by``; rows of ``tuned/*.json``, written by ``tune_twins.py``, carry the
    trial budget, ``trials``, too), and the paired deltas to the off twin with their SEs overall, on
    the rarest item quartile (``q0``) and on the coldest users (``cold``); the off twin's
    own rows carry None there.
    """
    from bft_lightning.metrics.report import write_text_atomic

    rows = []
    for table in sorted(res.glob("*_*.json")):
        if table.name == "summary.json":
            continue
        for row in json.loads(table.read_text()):
            noise = float(row.get("noise", 0.0))
            protocol = row_protocol(row)
            rows.append(summary_row(row, tuned=False, noise=noise, chosen_by=None,
                                    protocol=protocol, trials=None))  # fmt: skip
    for sel in sorted((res / "selected").glob("*.json")):
        rows.extend(selected_rows(sel))
    # twins tuned at the same budget (bench/tune_twins.py writes these rows itself)
    for tuned in sorted((res / "tuned").glob("*.json")):
        rows.extend(json.loads(tuned.read_text()).get("summary_rows", []))
    write_text_atomic(res / "summary.json", json.dumps(rows, indent=1))


def row_protocol(row: dict) -> str:
    """A table row's evaluation convention: its own ``protocol``, else (tables written
    before it was recorded) seen-masked only if its runs' overrides set mask_history."""
    if row.get("protocol"):
        return str(row["protocol"])
    commands = " ".join(row.get("commands", [])).lower()
    return "seen_masked" if "mask_history=true" in commands else "unmasked"


def selected_rows(path: Path) -> list[dict]:
    """The two chosen twins of one ``select_by_validation.py`` output, as summary rows."""
    doc = json.loads(path.read_text())
    comp, grid = doc["comparison"], doc["settings"]
    out = []
    for twin in ("off", "on"):
        table, variant = comp[twin].rsplit(":", 1)
        setting = next(r for r in grid if r["table"] == table and r["variant"] == variant)
        dataset, backbone = table.split("_")[:2]
        row = {
            "dataset": dataset, "backbone": backbone, "tag": f"selected/{path.stem}",
            "variant": variant, "seeds": setting["seeds"], "hr10": setting["hr10"],
            "ndcg10": setting["ndcg10"], "setting": comp[twin],
            "grid": sorted(f"{r['table']}:{r['variant']}" for r in grid if r["twin"] == twin),
            "tuned": True, "noise": float(doc.get("noise", 0.0)),
            "protocol": doc.get("protocol", "unmasked"),
            "trials": sum(1 for r in grid if r["twin"] == twin),
            "chosen_by": "val/ndcg@10 (mean of the best over the seeds)",
        }  # fmt: skip
        for key, name in (
            ("hr10", "delta_hr10"),
            ("ndcg10", "delta_ndcg10"),
            ("hr10_q0", "delta_hr10_q0"),
            ("hr10_cold", "delta_hr10_cold"),
        ):
            delta, se = comp[name] if twin == "on" else (None, None)
            row[f"paired_delta_{key}"], row[f"paired_se_{key}"] = delta, se
        out.append(row)
    return out
