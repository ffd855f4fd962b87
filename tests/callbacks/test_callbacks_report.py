"""Report writers: empty cells against undefined values, and atomic replacement of files."""

import math

import pytest
import torch
from matplotlib.figure import Figure

from bft_lightning.callbacks import report


def test_markdown_table_tells_empty_cells_from_nan_values():
    values = torch.tensor([[0.5, math.nan, math.nan]])
    empty = torch.tensor([[False, True, False]])
    table = report.markdown_table("t", ["L"], ["a", "b", "c"], values, empty=empty)
    assert table.splitlines()[-1] == "| L | 0.5000 | - | nan |"
    # without a mask nothing is known to be empty: NaN is never shown as "-"
    assert report.markdown_table("t", ["L"], ["a"], values[:, 1:2]).endswith("| L | nan |\n")


def test_a_failed_text_write_keeps_the_previous_report(tmp_path):
    path = tmp_path / "gain_by_stratum_val.md"
    report.write_text(str(path), "# epoch 1\n" * 50)
    with pytest.raises(UnicodeEncodeError):
        report.write_text(str(path), "# epoch 2 \udc80\n")
    assert path.read_text() == "# epoch 1\n" * 50
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_a_failed_plot_keeps_the_previous_png(tmp_path, monkeypatch):
    path = tmp_path / "gain_by_context_val.png"
    panels = [("K", ["L"], torch.tensor([[0.1, 0.2]]))]
    report.save_line_plot(str(path), ["1", "2"], panels, "title", "x")
    before = path.read_bytes()
    assert before[:4] == b"\x89PNG"

    def broken_savefig(self, fname, **kwargs):
        if isinstance(fname, str):
            with open(fname, "wb") as f:
                f.write(b"\x89PNG partial")
        else:
            fname.write(b"\x89PNG partial")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(OSError, match="disk full"):
        report.save_line_plot(str(path), ["1", "2"], panels, "title", "x")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
