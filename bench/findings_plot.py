"""The research verdict as one picture: BFT minus its off twin, paired, per comparison.

Reads the rows ``reproduce_rec.py`` wrote to ``results/rec/summary.json`` and the
comparisons ``select_by_validation.py`` wrote to ``results/rec/selected/*.json``
and draws, for each comparison, the paired difference in HR@10 and NDCG@10 over
all test users and the HR@10 difference on the rarest item quartile (Q0) and on
cold users, each with +-2 paired standard errors. Nothing is trained or
recomputed here; a comparison whose row is missing is an error that names it.

    python bench/findings_plot.py --out results/rec/findings.png

A comparison is ``LABEL=dataset:backbone:tag:variant[:protocol]`` (a summary row;
``tag`` may be empty; ``protocol`` ``seen_masked``, the default where a row has both,
or ``unmasked``) or ``LABEL=selected/NAME`` (``results/rec/selected/NAME.json``).
``--set tuned`` draws the current verdict instead, the tuned twins' rows (FINDINGS.md's
first table), to ``results/rec/tuned/verdict.png``:

    python bench/findings_plot.py --set tuned
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REC = ROOT / "results" / "rec"

# The comparisons FINDINGS.md reads, in its order.
DEFAULT = [
    "Beauty SASRec, dropout 0.2, loss per row=beauty:sasrec:rows:on_tau_lr10",
    "Beauty SASRec, dropout 0.3, loss per row=beauty:sasrec:rows_dropout03:on_tau_lr10",
    "Beauty SASRec, dropout 0.5, loss per row=beauty:sasrec:rows_dropout05:on_tau_lr10",
    "Beauty SASRec, val. choice, loss per row=selected/beauty_sasrec_rows",
    "Beauty SASRec, dropout 0.2=beauty:sasrec::on_tau_lr10",
    "Beauty SASRec, dropout 0.3=beauty:sasrec:dropout03:on_tau_lr10",
    "Beauty SASRec, dropout 0.5=beauty:sasrec:dropout05:on_frequency",
    "Beauty SASRec, each twin's val. choice=selected/beauty_sasrec",
    "Sports SASRec, dropout 0.2=sports:sasrec::on_tau_lr10",
    "Sports SASRec, dropout 0.5=sports:sasrec:dropout05:on_frequency",
    "Beauty HSTU, dropout 0.2=beauty:hstu::on_frequency",
    "Beauty BERT4Rec, prior scale 8=beauty:bert4rec:c8:on_c8",
]
# The tuned twins (bench/tune_twins.py), as FINDINGS.md's first table lists them.
TUNED = [
    "Beauty, 10 trials a twin=beauty:sasrec:tuned/beauty_sasrec_sasrec_ss256:on",
    "Beauty, 10% noise=beauty:sasrec:tuned/beauty_sasrec_sasrec_ss256_noise10:on",
    "Beauty, 30% noise=beauty:sasrec:tuned/beauty_sasrec_sasrec_ss256_noise30:on",
    "LastFM, full softmax=lastfm:sasrec:tuned/lastfm_sasrec_sasrec_ce:on",
    "LastFM, 256 negatives=lastfm:sasrec:tuned/lastfm_sasrec_sasrec_ss256:on",
    "Sports, 6 trials a twin=sports:sasrec:tuned/sports_sasrec_sasrec_ss256:on",
    "Sports, 10% noise=sports:sasrec:tuned/sports_sasrec_sasrec_ss256_noise10:on",
    "Sports, 30% noise=sports:sasrec:tuned/sports_sasrec_sasrec_ss256_noise30:on",
    "Toys, 6 trials a twin=toys:sasrec:tuned/toys_sasrec_sasrec_ss256:on",
    "Yelp, 6 trials a twin=yelp:sasrec:tuned/yelp_sasrec_sasrec_ss256:on",
]
SETS = {"earlier": (DEFAULT, REC / "findings.png"), "tuned": (TUNED, REC / "tuned" / "verdict.png")}
PANELS = [
    ("hr10", "ΔHR@10, all users"),
    ("ndcg10", "ΔNDCG@10, all users"),
    ("hr10_q0", "ΔHR@10, rarest items (Q0)"),
    ("hr10_cold", "ΔHR@10, cold users"),
]


def verdict(delta: float, se: float) -> str:
    """ "ahead" / "behind" beyond two paired SE, else "level" (the colour of a point)."""
    if abs(delta) > 2 * se:
        return "ahead" if delta > 0 else "behind"
    return "level"


COLOURS = {"ahead": "tab:green", "behind": "tab:red", "level": "tab:gray"}


def load(
    spec: str, rows: list[dict], rec: Path = REC
) -> tuple[str, dict[str, tuple[float, float]]]:
    """One comparison's label and its {panel: (delta, se)}; ``selected/NAME`` is read
    from ``rec / selected / NAME.json`` (``rec``: the folder of the summary)."""
    if "=" not in spec:
        raise ValueError(f"comparison {spec!r}: expected LABEL=SOURCE")
    label, source = spec.split("=", 1)
    if source.startswith("selected/"):
        path = rec / f"{source}.json"
        if not path.is_file():
            raise FileNotFoundError(f"comparison {label!r}: {path} does not exist")
        comp = json.loads(path.read_text())["comparison"]
        return label, {key: tuple(comp[f"delta_{key}"]) for key, _ in PANELS}
    parts = source.split(":")
    if len(parts) not in (4, 5):
        raise ValueError(
            f"comparison {label!r}: expected dataset:backbone:tag:variant[:protocol], "
            f"got {source!r}"
        )
    dataset, backbone, tag, variant = parts[:4]
    protocol = parts[4] if len(parts) == 5 else None
    matching = [
        row for row in rows
        if (row["dataset"], row["backbone"], row.get("tag", ""), row["variant"])
        == (dataset, backbone, tag, variant)
    ]  # fmt: skip
    if protocol is None:  # the published convention where a run kept both
        masked = [row for row in matching if row.get("protocol") == "seen_masked"]
        matching = masked or matching
    else:
        matching = [row for row in matching if row.get("protocol") == protocol]
    if matching:
        row = matching[0]
        if row.get("paired_delta_hr10") is None:
            raise ValueError(f"comparison {label!r}: row {source!r} has no paired deltas")
        return label, {
            key: (row[f"paired_delta_{key}"], row[f"paired_se_{key}"]) for key, _ in PANELS
        }
    raise KeyError(f"comparison {label!r}: no row {source!r} in {rec / 'summary.json'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--set", choices=list(SETS), default="earlier",
                   help="the default comparisons and picture (default: earlier)")  # fmt: skip
    p.add_argument("--comparisons", nargs="+", default=None)
    p.add_argument("--summary", type=Path, default=REC / "summary.json")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    chosen, picture = SETS[args.set]
    args.comparisons = args.comparisons or chosen
    args.out = args.out or picture

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = json.loads(args.summary.read_text())
    comps = [load(spec, rows, args.summary.parent) for spec in args.comparisons]
    fig = Figure(figsize=(13, 0.45 * len(comps) + 1.6))
    axes = fig.subplots(1, len(PANELS), sharey=True)
    ys = list(range(len(comps)))[::-1]
    for ax, (key, title) in zip(axes, PANELS):
        for y, (_, vals) in zip(ys, comps):
            delta, se = vals[key]
            colour = COLOURS[verdict(delta, se)]
            ax.errorbar(delta, y, xerr=2 * se, fmt="o", color=colour, capsize=3)
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(4))
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels([label for label, _ in comps], fontsize=9)
    fig.suptitle(
        "BFT minus its off twin, paired on the same test users (±2 SE; green / red: beyond 2 SE)",
        fontsize=11,
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp.png")
    FigureCanvasAgg(fig).print_png(str(tmp))
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
