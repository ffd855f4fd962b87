"""Evaluation reports: ``metrics.json``, ``metrics.md`` and ``strata.png``.

Input is the flat dict of :meth:`RankingMetric.compute` (keys ``"hr@10"``,
``"item_q0/ndcg@10"``, ``"user_b3/gain"``, ...; see ``ranking.py``).
``metrics.json`` holds that dict as is, with NaN (empty stratum) written as
``null``; :func:`read_metrics` reads it back with NaN restored. Every file is
written atomically (temporary file in the same folder, then ``os.replace``).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

STRATA: tuple[tuple[str, str], ...] = (
    ("", "overall"),
    ("item_q0/", "item Q0 (rarest)"),
    ("item_q1/", "item Q1"),
    ("item_q2/", "item Q2"),
    ("item_q3/", "item Q3 (most popular)"),
    ("user_b0/", "user B0 (cold)"),
    ("user_b1/", "user B1"),
    ("user_b2/", "user B2"),
    ("user_b3/", "user B3 (longest)"),
)


# ----------------------------------------------------------------------------- files
# read once, at import: os.umask can only be read by setting it (process-wide)
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write via a temp file in ``path.parent`` then ``os.replace`` (no torn files), with
    the permissions a plain ``open`` would give (``mkstemp`` makes its file 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file: a reader never sees
    a half-written file, and an interrupted write leaves the old one."""
    _atomic_write(Path(path), lambda f: f.write(text.encode("utf-8")))


def _json_safe(metrics: dict[str, float]) -> dict[str, float | None]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}


def read_metrics(path: str | os.PathLike) -> dict[str, float]:
    """Load ``metrics.json``; ``null`` becomes NaN."""
    raw = json.loads(Path(path).read_text())
    return {k: (math.nan if v is None else float(v)) for k, v in raw.items()}


# ----------------------------------------------------------------------------- tables
def _ks(metrics: dict[str, float]) -> list[int]:
    return sorted({int(m.group(1)) for key in metrics if (m := re.fullmatch(r"hr@(\d+)", key))})


def _columns(metrics: dict[str, float]) -> list[tuple[str, str]]:
    """(key, header) pairs: HR@k, NDCG@k (k > 1; NDCG@1 = HR@1), MRR, n, mean K."""
    ks = _ks(metrics)
    cols = [(f"hr@{k}", f"HR@{k}") for k in ks]
    cols += [(f"ndcg@{k}", f"NDCG@{k}") for k in ks if k > 1]
    cols += [("mrr", "MRR"), ("n", "n")]
    if "gain" in metrics:
        cols.append(("gain", "mean K"))
    return cols


def _fmt(value: float | None, key: str) -> str:
    if value is None:
        return "–"
    if math.isnan(value):
        return "nan"
    if key.split("/")[-1] == "n":
        return str(int(value))
    return "0" if value == 0 else f"{value:#.4g}"  # four significant digits


def _fmt_delta(delta: float, key: str) -> str:
    return f"{delta:+.0f}" if key.split("/")[-1] == "n" else f"{delta:+.4f}"


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def strata_table(metrics: dict[str, float]) -> str:
    """Markdown table: rows = overall, item Q0..Q3, user B0..B3 (those present)."""
    cols = _columns(metrics)
    rows = [
        [label] + [_fmt(metrics.get(prefix + key), key) for key, _ in cols]
        for prefix, label in STRATA
        if f"{prefix}n" in metrics
    ]
    return _md_table(["stratum"] + [h for _, h in cols], rows)


def _compare_keys(runs: dict[str, dict[str, float]]) -> list[str]:
    first = next(iter(runs.values()))
    keys = [key for key, _ in _columns(first) if key != "n"]
    k = 10 if 10 in _ks(first) else max(_ks(first), default=10)
    for prefix, _ in STRATA[1:]:
        keys += [prefix + name for name in (f"hr@{k}", f"ndcg@{k}", "gain")]
    keys.append("n")
    return [key for key in keys if any(key in m for m in runs.values())]


def compare_table(runs: dict[str, dict[str, float]]) -> str:
    """Markdown side-by-side table of two or more runs, with differences to the first.

    Rows: overall HR@k / NDCG@k / MRR (/ mean K), then HR/NDCG@10 (and K) per
    stratum, then n. Columns: one per run, then ``<run> − <first>`` per other run.
    """
    if len(runs) < 2:
        raise ValueError("compare_table needs at least two runs")
    names = list(runs)
    base = runs[names[0]]
    rows = []
    for key in _compare_keys(runs):
        row = [key] + [_fmt(runs[n].get(key), key) for n in names]
        for n in names[1:]:
            a, b = base.get(key), runs[n].get(key)
            row.append("–" if a is None or b is None else _fmt_delta(b - a, key))
        rows.append(row)
    header = ["metric"] + names + [f"{n} − {names[0]}" for n in names[1:]]
    return _md_table(header, rows)


# ----------------------------------------------------------------------------- figure
def _strata_figure(metrics: dict[str, float], title: str):
    """Bars per stratum for HR@10, NDCG@10 (and mean K); dashed line = overall."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, no global backend
    from matplotlib.figure import Figure

    k = 10 if 10 in _ks(metrics) else max(_ks(metrics), default=10)
    panels = [(f"hr@{k}", f"HR@{k}"), (f"ndcg@{k}", f"NDCG@{k}")]
    if "gain" in metrics:
        panels.append(("gain", "mean K"))
    strata = [(p, lbl) for p, lbl in STRATA[1:] if f"{p}n" in metrics]
    fig = Figure(figsize=(4.2 * len(panels), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (key, label) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        vals = [metrics.get(p + key, math.nan) for p, _ in strata]
        colors = ["tab:blue" if p.startswith("item") else "tab:orange" for p, _ in strata]
        ax.bar(range(len(strata)), vals, color=colors)
        ax.axhline(metrics.get(key, math.nan), color="k", ls="--", lw=1, label="overall")
        ax.set_xticks(range(len(strata)), [p.rstrip("/") for p, _ in strata], rotation=45)
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


# ----------------------------------------------------------------------------- entry point
def write_report(
    metrics: dict[str, float], out_dir: str | os.PathLike, title: str, partial: str | None = None
) -> dict:
    """Write ``metrics.json``, ``metrics.md`` and ``strata.png`` to ``out_dir``.

    ``partial`` (e.g. ``"12 of 40 test batches"``): the evaluation did not see
    every user; the files are ``metrics_partial.*`` / ``strata_partial.png``,
    say so at the top, and never replace a full evaluation's files.

    Returns ``{"json": Path, "md": Path, "png": Path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "_partial" if partial else ""
    paths = {"json": out / f"metrics{tag}.json", "md": out / f"metrics{tag}.md",
             "png": out / f"strata{tag}.png"}  # fmt: skip
    shown = _json_safe(metrics) | ({"partial": partial} if partial else {})
    payload = json.dumps(shown, indent=2, sort_keys=True, allow_nan=False)
    _atomic_write(paths["json"], lambda f: f.write(payload.encode()))
    note = (
        f"**Partial evaluation: {partial}.** Not every user was evaluated; a full "
        "evaluation writes metrics.md.\n\n" if partial else ""
    )  # fmt: skip
    md = f"# {title}\n\n{note}{strata_table(metrics)}"
    _atomic_write(paths["md"], lambda f: f.write(md.encode()))
    fig = _strata_figure(metrics, title)
    _atomic_write(paths["png"], lambda f: fig.savefig(f, format="png", dpi=100))
    return paths
