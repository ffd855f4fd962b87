"""Two runs on the same test users: per-stratum metrics, paired differences, one figure.

:func:`per_user` reads a computed :class:`~bft_lightning.metrics.RankingMetric`
(after ``trainer.test``) into per-user arrays: HR@k, NDCG@k, gain, and the
item stratum (popularity quartile of the target) and user bucket (history
length) of each user, as the metric defines them. :func:`paired_rows` compares
two runs user by user: the difference ``b - a`` of the per-user values, its
mean and its standard error ``sd(d) / sqrt(n)`` over the users of each row (the
same users in both runs, so the pairing removes the spread between users).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bft_lightning.metrics.report import _atomic_write

__all__ = ["ROWS", "paired_figure", "paired_rows", "paired_table", "per_user"]

# (row label, which array selects it, value): overall, then items Q0..Q3, users B0..B3
ROWS: tuple[tuple[str, str, int], ...] = (
    ("overall", "", -1),
    *((f"item Q{j}" + (" (rarest)" if j == 0 else ""), "item", j) for j in range(4)),
    *((f"user B{j}" + (" (cold)" if j == 0 else ""), "user", j) for j in range(4)),
)


def per_user(metric: Any, k: int = 10) -> dict[str, np.ndarray]:
    """Per evaluated user: ``user``, ``hr``, ``ndcg`` (at ``k``), ``gain``, ``item``, ``user_b``."""
    seen = metric.rank >= 0
    users = seen.nonzero().flatten()
    rank = metric.rank[seen].double()
    hit = rank < k
    out = {
        "user": users.cpu().numpy(),
        "hr": hit.double().cpu().numpy(),
        "ndcg": (hit.double() / (rank + 2).log2()).cpu().numpy(),
    }
    gain = metric.gain[seen]
    out["gain"] = np.where(np.isfinite(gain.cpu().numpy()), gain.cpu().numpy(), np.nan)
    item = metric._item_stratum(metric.target[seen])
    bucket = metric._user_bucket(metric.history_len[seen])
    out["item"] = np.full(len(users), -1) if item is None else item.cpu().numpy()
    out["user_b"] = np.full(len(users), -1) if bucket is None else bucket.cpu().numpy()
    return out


def _select(u: dict[str, np.ndarray], kind: str, j: int) -> np.ndarray:
    if kind == "":
        return np.ones(len(u["user"]), dtype=bool)
    return u["item" if kind == "item" else "user_b"] == j


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else math.nan


def paired_rows(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray]
) -> list[dict[str, Any]]:  # fmt: skip
    """One dict per row of :data:`ROWS`: ``n``, ``{a,b}_{hr,ndcg}``, ``d_*``, ``se_*``, gains."""
    if not np.array_equal(a["user"], b["user"]):
        raise ValueError(
            "paired comparison: the two runs evaluated different users "
            f"({len(a['user'])} against {len(b['user'])}); run them on the same data and split"
        )
    rows = []
    for label, kind, j in ROWS:
        keep = _select(a, kind, j)
        row: dict[str, Any] = {"label": label, "n": int(keep.sum())}
        for name in ("hr", "ndcg"):
            d = b[name][keep] - a[name][keep]
            row[f"a_{name}"], row[f"b_{name}"] = _mean(a[name][keep]), _mean(b[name][keep])
            row[f"d_{name}"] = _mean(d)
            row[f"se_{name}"] = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan
        for side, u in (("a", a), ("b", b)):
            g = u["gain"][keep]
            g = g[np.isfinite(g)]
            row[f"{side}_gain"] = _mean(g)
        rows.append(row)
    return rows


def _g(x: float) -> str:
    if math.isnan(x):
        return "–"
    return "0" if x == 0 else f"{x:#.4g}"


def _pm(d: float, se: float) -> str:
    if math.isnan(d):
        return "–"
    if d == 0 and se == 0:
        return "0"
    return f"{d:+#.3g} ± {se:#.2g}" if not math.isnan(se) else f"{d:+#.3g}"


def paired_table(rows: Sequence[dict[str, Any]], names: tuple[str, str], k: int = 10) -> str:
    """Markdown: per row n, HR@k and NDCG@k of both runs, the paired difference ± its SE."""
    a, b = names
    header = ["", "n", f"HR@{k} {a}", f"HR@{k} {b}", f"{b} − {a} (± SE)"]
    header += [f"NDCG@{k} {a}", f"NDCG@{k} {b}", f"{b} − {a} (± SE)"]
    with_gain = any(not math.isnan(r["b_gain"]) for r in rows)
    if with_gain:
        header.append(f"mean K {b}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["label"], str(r["n"])]
        for name in ("hr", "ndcg"):
            cells += [_g(r[f"a_{name}"]), _g(r[f"b_{name}"]), _pm(r[f"d_{name}"], r[f"se_{name}"])]
        if with_gain:
            cells.append(_g(r["b_gain"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_figure(
    rows: Sequence[dict[str, Any]], names: tuple[str, str], path: str | Path, title: str,
    k: int = 10,
) -> Path:  # fmt: skip
    """Grouped bars per row, run ``a`` beside run ``b``, HR@k and NDCG@k; ``n`` under each
    group; the error bar on ``b`` is the SE of the paired difference. Written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    x = np.arange(len(rows))
    labels = [f"{r['label']}\nn={r['n']}" for r in rows]
    for i, (name, pretty) in enumerate((("hr", f"HR@{k}"), ("ndcg", f"NDCG@{k}"))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.bar(x - 0.2, [r[f"a_{name}"] for r in rows], 0.4, label=names[0], color="tab:gray")
        ax.bar(
            x + 0.2, [r[f"b_{name}"] for r in rows], 0.4, label=names[1], color="tab:blue",
            yerr=[0 if math.isnan(r[f"se_{name}"]) else r[f"se_{name}"] for r in rows],
            capsize=2,
        )  # fmt: skip
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(f"test {pretty}")
        ax.set_title(f"{pretty} (error bar: SE of the paired difference)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=100))
    return out
