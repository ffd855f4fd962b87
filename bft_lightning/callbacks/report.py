"""Small writers for analysis callbacks: Markdown tables and line plots (PNG).

Plots use matplotlib's object API with the Agg canvas, so no global backend
or pyplot state is touched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from torch import Tensor


def markdown_table(
    title: str, row_labels: Sequence[str], col_labels: Sequence[str], values: Tensor,
    fmt: str = "{:.4f}",
) -> str:  # fmt: skip
    """A Markdown table with a ``### title``; NaN cells print as ``-``."""
    lines = [f"### {title}", "", "| | " + " | ".join(col_labels) + " |"]
    lines.append("|---" * (len(col_labels) + 1) + "|")
    for label, row in zip(row_labels, values.tolist()):
        cells = ["-" if math.isnan(v) else fmt.format(v) for v in row]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


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
    fig.savefig(path, dpi=100)
