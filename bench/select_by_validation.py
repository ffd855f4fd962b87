"""Each twin at its best setting, chosen on validation: off against on, paired on test.

``reproduce_rec.py`` compares twins at one setting. This script answers the
research issue's "at the models' best settings": from finished runs of
several settings (a setting = a runs table and a variant, e.g. dropout 0.2 or
0.5, tau at 1x or 10x the learning rate), it picks for each twin the setting
with the highest mean best-validation NDCG@10 (the metric the protocol stops
and checkpoints on) over the seeds on which every setting of that twin kept
its validation log, then reports the test
metrics of all settings and the paired difference of the two selected ones
on the same test users: overall, rarest items (Q0) and cold users, with the
same-seed differences. Nothing is trained here; it reads
``<runs-dir>/<table>/<variant>_s<seed>/`` as ``reproduce_rec.py`` writes them
(the best validation NDCG@10 from each run's TensorBoard log).

    python bench/select_by_validation.py --off beauty_sasrec:off beauty_sasrec_dropout05:off \\
        --on beauty_sasrec:on_tau_lr10 beauty_sasrec_dropout05:on_frequency \\
             beauty_sasrec_dropout05:on_tau_lr10 \\
        --seeds 0 1 2 3 --out results/rec/selected/beauty_sasrec.md
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.paired import hits, mean_se, ndcg, paired  # noqa: E402
from common.runs import run_arrays  # noqa: E402

from bft_lightning.metrics.strata import (  # noqa: E402
    assign_item_stratum,
    assign_user_bucket,
    history_buckets,
    popularity_quartiles,
)

ROOT = Path(__file__).resolve().parents[1]


def best_validation(run_dir: Path, metric: str = "val/ndcg@10") -> tuple[float, int] | None:
    """The best value of ``metric`` in a run's TensorBoard log and its step.

    None when the run kept no log of it (runs trained elsewhere and brought back
    with their ranks and summary only).
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = sorted((run_dir / "tb").glob("version_*"))
    events = []
    for log in logs:
        acc = EventAccumulator(str(log), size_guidance={"scalars": 0})
        acc.Reload()
        if metric in acc.Tags()["scalars"]:
            events += acc.Scalars(metric)
    if not events:
        return None
    best = max(events, key=lambda e: e.value)
    return float(best.value), int(best.step)


def parse_setting(text: str) -> tuple[str, str]:
    table, sep, variant = text.partition(":")
    if not sep or not table or not variant:
        raise SystemExit(f"a setting is TABLE:VARIANT (e.g. beauty_sasrec:off), got {text!r}")
    return table, variant


def load_setting(base: Path, table: str, variant: str, seeds: list[int]) -> dict:
    """Per-seed ranks, best validation NDCG@10 and the data's strata of one setting."""
    runs = {}
    for seed in seeds:
        out = base / table / f"{variant}_s{seed}"
        if not (out / "summary.json").exists():
            raise SystemExit(f"{out}: no finished run (summary.json missing)")
        runs[seed] = {
            "ranks": np.load(out / "ranks.npy"), **run_arrays(out), "val": best_validation(out),
            "summary": json.loads((out / "summary.json").read_text()),
        }  # fmt: skip
    return runs


def strata_of(run: dict, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q0 mask (target among the rarest quarter of items) and cold-user mask."""
    freq = torch.as_tensor(run["item_frequency"])
    targets = torch.as_tensor(run["targets"]).clamp_min(1)
    q0 = assign_item_stratum(targets, freq, popularity_quartiles(freq)).numpy() == 0
    seen = lengths >= 0
    bounds = history_buckets(torch.as_tensor(lengths[seen]))
    cold = (assign_user_bucket(torch.as_tensor(lengths), bounds).numpy() == 0) & seen
    return q0, cold


def per_user(runs: dict, seeds: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ranks = np.stack([runs[s]["ranks"] for s in seeds])
    seen = (ranks >= 0).all(0)
    return hits(ranks).mean(0), ndcg(ranks).mean(0), seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs-dir", default=str(ROOT / "logs" / "reproduce"))
    p.add_argument("--off", nargs="+", required=True, help="TABLE:VARIANT settings of the off twin")
    p.add_argument("--on", nargs="+", required=True, help="TABLE:VARIANT settings of BFT")
    p.add_argument("--seeds", nargs="+", type=int, required=True)
    p.add_argument("--out", default=None, help="Markdown table (and .json beside it)")
    p.add_argument(
        "--min-val-seeds", type=int, default=2,
        help="fewest seeds with a validation log a setting needs to be chosen on",
    )  # fmt: skip
    args = p.parse_args()
    base = Path(args.runs_dir)
    twins = {"off": [parse_setting(s) for s in args.off], "on": [parse_setting(s) for s in args.on]}
    data = {
        (twin, table, variant): load_setting(base, table, variant, args.seeds)
        for twin, settings in twins.items()
        for table, variant in settings
    }
    reference = next(iter(data.values()))[args.seeds[0]]
    for key, runs in data.items():
        for seed, run in runs.items():
            if not np.array_equal(run["targets"], reference["targets"]):
                raise SystemExit(f"{key} seed {seed}: other test users/targets; not comparable")
    lengths = [r["history_len"] for runs in data.values() for r in runs.values()]
    lengths = [x for x in lengths if x is not None]
    if not lengths:
        raise SystemExit("no run saved history_len.npy: cold users cannot be told apart")
    q0, cold = strata_of(reference, lengths[0])

    # the choice within a twin is made on the seeds every one of its settings logged,
    # so a setting is never preferred for a seed it lacks
    common = {
        twin: [
            s for s in args.seeds
            if all(runs[s]["val"] is not None for (t, *_), runs in data.items() if t == twin)
        ]
        for twin in ("off", "on")
    }  # fmt: skip
    rows = []
    for (twin, table, variant), runs in data.items():
        hr, nd, _ = per_user(runs, args.seeds)
        seen = (np.stack([runs[s]["ranks"] for s in args.seeds]) >= 0).all(0)
        logged = common[twin]
        if len(logged) < args.min_val_seeds:
            have = [s for s in args.seeds if runs[s]["val"] is not None]
            raise SystemExit(
                f"{twin} twin: validation logged by every setting on seeds {logged} only "
                f"({table}:{variant} has {have}); --min-val-seeds {args.min_val_seeds}"
            )
        rows.append({
            "twin": twin, "table": table, "variant": variant, "seeds": args.seeds,
            "val_seeds": logged,
            "val_ndcg10": float(np.mean([runs[s]["val"][0] for s in logged])),
            "val_ndcg10_per_seed": [runs[s]["val"][0] for s in logged],
            "hr10": float(hr[seen].mean()), "ndcg10": float(nd[seen].mean()),
            "hr10_q0": float(hr[seen & q0].mean()), "hr10_cold": float(hr[seen & cold].mean()),
            "hardware": sorted({runs[s]["summary"].get("hardware", "?") for s in args.seeds}),
        })  # fmt: skip
    chosen = {
        twin: max((r for r in rows if r["twin"] == twin), key=lambda r: r["val_ndcg10"])
        for twin in ("off", "on")
    }
    a = data[("off", chosen["off"]["table"], chosen["off"]["variant"])]
    b = data[("on", chosen["on"]["table"], chosen["on"]["variant"])]
    hr_a, nd_a, seen_a = per_user(a, args.seeds)
    hr_b, nd_b, seen_b = per_user(b, args.seeds)
    seen = seen_a & seen_b
    comparison = {
        "off": f"{chosen['off']['table']}:{chosen['off']['variant']}",
        "on": f"{chosen['on']['table']}:{chosen['on']['variant']}",
        "delta_hr10": paired(hr_a[seen], hr_b[seen]),
        "delta_ndcg10": paired(nd_a[seen], nd_b[seen]),
        "delta_hr10_q0": paired(hr_a[seen & q0], hr_b[seen & q0]),
        "delta_hr10_cold": paired(hr_a[seen & cold], hr_b[seen & cold]),
        "per_seed_delta_hr10": [
            float(per_user(b, [s])[0][seen].mean() - per_user(a, [s])[0][seen].mean())
            for s in args.seeds
        ],
        "per_seed_delta_ndcg10": [
            float(per_user(b, [s])[1][seen].mean() - per_user(a, [s])[1][seen].mean())
            for s in args.seeds
        ],
    }
    text = render(rows, chosen, comparison, args)
    print(text)
    if args.out:
        out = Path(args.out)  # not beside reproduce_rec.py's tables: its summary reads those
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(
            json.dumps({"settings": rows, "comparison": comparison}, indent=1)
        )


def _pm(pair: tuple[float, float]) -> str:
    return f"{pair[0]:+.4f} ({pair[1]:.4f})"


def render(rows: list[dict], chosen: dict, comparison: dict, args: argparse.Namespace) -> str:
    command = "python bench/select_by_validation.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    lines = [
        "# Each twin at its best setting, chosen on validation",
        "",
        f"Command: `{command}`",
        "",
        "Per twin, the setting with the highest mean best-validation NDCG@10 (the metric "
        "the protocol stops and checkpoints on) is chosen, over the seeds on which every "
        "setting of that twin kept its validation log (runs trained on a GPU machine came "
        "back with ranks and summaries only); test numbers are over seeds "
        f"{', '.join(map(str, args.seeds))}, each run at its best-validation checkpoint. "
        "The settings' tables in `results/rec/` say how each was trained.",
        "",
        "| twin | setting | val NDCG@10 (mean) | val NDCG@10 by seed | test HR@10 | "
        "test NDCG@10 | HR@10 Q0 | HR@10 cold | hardware |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["twin"] != "off", -r["val_ndcg10"])):
        mark = "**" if r is chosen[r["twin"]] else ""
        per_seed = ", ".join(
            f"s{s} {v:.4f}" for s, v in zip(r["val_seeds"], r["val_ndcg10_per_seed"], strict=True)
        )
        lines.append(
            f"| {r['twin']} | {mark}{r['table']}:{r['variant']}{mark} | {r['val_ndcg10']:.4f} | "
            f"{per_seed} | {r['hr10']:.4f} | {r['ndcg10']:.4f} | {r['hr10_q0']:.4f} | "
            f"{r['hr10_cold']:.4f} | {', '.join(r['hardware'])} |"
        )
    c = comparison

    def over_seeds(deltas: list[float]) -> str:
        each = ", ".join(f"{d:+.4f}" for d in deltas)
        if len(deltas) < 2:
            return each
        mean, se = mean_se(deltas)
        return f"{each}; mean {mean:+.4f} ({se:.4f})"

    lines += [
        "",
        f"Chosen: off = `{c['off']}`, on = `{c['on']}`. On minus off, paired on the same "
        "test users (seed-averaged per user; ± paired SE, the spread over users, not over "
        "trainings); the same-seed columns give each seed's difference and, in brackets, "
        "the SE over seeds (SD / sqrt(seeds)), the one to read when seeds are few:",
        "",
        "| ΔHR@10 | ΔNDCG@10 | ΔHR@10 Q0 (rarest) | ΔHR@10 cold | same-seed ΔHR@10 | "
        "same-seed ΔNDCG@10 |",
        "|---|---|---|---|---|---|",
        f"| {_pm(c['delta_hr10'])} | {_pm(c['delta_ndcg10'])} | {_pm(c['delta_hr10_q0'])} | "
        f"{_pm(c['delta_hr10_cold'])} | {over_seeds(c['per_seed_delta_hr10'])} | "
        f"{over_seeds(c['per_seed_delta_ndcg10'])} |",
        "",
    ]
    if any(math.isnan(x) for x in c["delta_hr10"]):
        lines.append("(one seed: no SE)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
