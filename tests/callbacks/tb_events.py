"""Read what a TensorBoard run wrote (histograms and scalars), for the callback tests."""

from __future__ import annotations

from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_events(log_dir: str) -> tuple[dict[str, list[tuple[int, Any]]], dict[str, list]]:
    """``({histogram tag: [(step, HistogramValue)]}, {scalar tag: [(step, value)]})``."""
    ea = EventAccumulator(log_dir, size_guidance={"histograms": 0, "scalars": 0})
    ea.Reload()
    tags = ea.Tags()
    hists = {t: [(e.step, e.histogram_value) for e in ea.Histograms(t)] for t in tags["histograms"]}
    scalars = {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in tags["scalars"]}
    return hists, scalars
