"""The README's attach example runs as shipped and logs BFT histograms."""

import runpy
from pathlib import Path

import pytest
from tb_events import read_events

EXAMPLE = Path(__file__).parents[2] / "examples" / "attach_precision_monitor.py"


@pytest.mark.filterwarnings("ignore")
def test_attach_example_runs_and_logs_histograms(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert "logged 2 times" in capsys.readouterr().out
    hists, scalars = read_events(str(tmp_path / "lightning_logs" / "version_0"))
    for layer in ("encoder.layers.0", "encoder.layers.1"):
        assert [s for s, _ in hists[f"bft/{layer}/gain"]] == [0, 50]
        assert [s for s, _ in hists[f"bft/{layer}/log_prec"]] == [0, 50]
        assert [s for s, _ in scalars[f"bft/{layer}/gain/p90"]] == [0, 50]
