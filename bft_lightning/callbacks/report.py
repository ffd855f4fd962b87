"""Small writers for analysis callbacks: Markdown tables and line plots (PNG).

Plots use matplotlib's object API with the Agg canvas, so no global backend
or pyplot state is touched. Every file is written to a temporary file in the
same folder and then renamed over the old one, so a failed write leaves the
previous report intact instead of an empty or torn file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from bft_lightning.metrics.report import _atomic_write


def markdown_table(
    title: str, row_labels: Sequence[str], col_labels: Sequence[str], values: Tensor,
    fmt: str = "{:.4f}", empty: Tensor | None = None,
) -> str:  # fmt: skip
    """A Markdown table with a ``### title``.

    Cells where ``empty`` (a bool tensor shaped like ``values``) is True print
    as ``-`` (nothing measured); any other NaN prints as ``nan``, so a value
    that is undefined for another reason (a zero variance, a diverging layer)
    is not mistaken for an empty cell.
    """
    lines = [f"### {title}", "", "| | " + " | ".join(col_labels) + " |"]
    lines.append("|---" * (len(col_labels) + 1) + "|")
    blank = torch.zeros_like(values, dtype=torch.bool) if empty is None else empty
    for label, row, row_empty in zip(row_labels, values.tolist(), blank.tolist()):
        cells = [_cell(v, e, fmt) for v, e in zip(row, row_empty)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: float, empty: bool, fmt: str) -> str:
    if empty:
        return "-"
    return "nan" if math.isnan(value) else fmt.format(value)


def write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) atomically, creating the folder if needed."""
    data = text.encode("utf-8")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _atomic_write(Path(path), lambda f: f.write(data))


def save_line_plot(
    path: str,
    x_labels: Sequence[str],
    panels: Sequence[tuple[str, Sequence[str], Tensor]],
    title: str,
    x_title: str,
) -> None:
    """One panel per ``(y title, series labels, values (series, x))``; a line per series."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(panels), 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    xs = list(range(len(x_labels)))
    for k, (y_title, labels, values) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for label, ys in zip(labels, values.tolist()):
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xticks(xs, list(x_labels), rotation=45 if len(xs) > 6 else 0)
        ax.set_xlabel(x_title)
        ax.set_ylabel(y_title)
        ax.grid(alpha=0.3)
        if labels:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _atomic_write(Path(path), lambda f: fig.savefig(f, format="png", dpi=100))
