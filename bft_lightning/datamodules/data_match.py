"""Is this the data a checkpoint was trained on? One check, used wherever the two meet.

A checkpoint records its training data's fingerprint (file digests, or the
synthetic options), its reader format and its vocabulary (raw item ids and
training counts). When data is given with a checkpoint (``test``,
``validate``, ``predict``, ``fit --ckpt_path``, ``calibrate``) and the
fingerprint differs, the ids alone prove nothing: two data sets with integer
ids 1..N "map" completely. So the overlap is measured in counts:

- ``data_known``: the share of the data's interactions whose item id the
  checkpoint knows;
- ``checkpoint_present``: the share of the checkpoint's training interactions
  whose item occurs in the data;
- ``popularity``: the overlap of the two item-popularity distributions
  (``sum_i min(p_i, q_i)`` over the checkpoint's items, 1 = identical).

Another reader format, or any of the three below :data:`MIN_OVERLAP`, is an
:class:`OtherDataError` naming both data sets, unless the caller allows other
data (``--allow_other_data``; ``SequenceDataModule(allow_other_data=True)``),
e.g. for a newer log of the same shop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MIN_OVERLAP", "DataMatch", "OtherDataError", "check_data_match", "describe_fingerprint"]

MIN_OVERLAP = 0.5
_COUNTS = ("users", "items", "interactions")


class OtherDataError(ValueError):
    """Data that is not the checkpoint's (low overlap or another reader format)."""


@dataclass(frozen=True)
class DataMatch:
    """How data overlaps a checkpoint's training data (shares in [0, 1])."""

    data_known: float
    checkpoint_present: float
    popularity: float

    def low(self, threshold: float = MIN_OVERLAP) -> bool:
        return min(self.data_known, self.checkpoint_present, self.popularity) < threshold

    def describe(self) -> str:
        return (
            f"{self.data_known:.0%} of the data's interactions have item ids the checkpoint "
            f"knows, {self.checkpoint_present:.0%} of its training interactions are on items in "
            f"the data, item popularity overlap {self.popularity:.0%}"
        )


def describe_fingerprint(fingerprint: dict[str, Any] | None) -> str:
    """A data set named from its fingerprint, for messages."""
    if not fingerprint:
        return "unrecorded data"
    if "source" in fingerprint:
        return str(fingerprint["source"])
    synthetic = fingerprint.get("synthetic")
    if isinstance(synthetic, dict):
        shown = ", ".join(f"{k}={v}" for k, v in synthetic.items())
        return f"synthetic data ({shown})"
    return "unnamed data"


def same_fingerprint(saved: dict[str, Any] | None, current: dict[str, Any]) -> bool:
    """Whether ``saved`` (a checkpoint's, with counts) names the data ``current`` names."""
    if not saved:
        return False
    strip = {k: v for k, v in saved.items() if k not in _COUNTS}
    if "files" in strip and "files" in current:
        return strip["files"] == current["files"] and strip.get("kcore") == current.get("kcore")
    return strip == {k: v for k, v in current.items() if k not in _COUNTS}


def measure(
    item_ids: Sequence[str], item_frequency: Any, data_item_ids: Sequence[str], data_counts: Any
) -> DataMatch:
    """The overlap of data with a checkpoint's vocabulary.

    ``data_counts[i]``: the data's training count of item ``data_item_ids[i]`` (counted as
    the checkpoint's ``item_frequency`` is: the leave-one-out training part), so that the
    same data overlaps its checkpoint exactly.
    """
    index = {str(raw): i for i, raw in enumerate(item_ids) if i > 0}
    freq = np.asarray(item_frequency, dtype=np.float64)[: len(item_ids)]
    counts = np.zeros(len(data_item_ids), dtype=np.float64)
    given = np.asarray(data_counts, dtype=np.float64)[: len(data_item_ids)]
    counts[: len(given)] = given
    codes = np.array([index.get(str(raw), 0) for raw in data_item_ids], dtype=np.int64)
    codes[:1] = 0  # padding
    total = counts[1:].sum()
    known = counts[codes > 0].sum() if len(codes) else 0
    data_known = float(known / total) if total else 0.0
    mapped = np.zeros(len(item_ids), dtype=np.float64)  # data counts in the checkpoint's ids
    np.add.at(mapped, codes[codes > 0], counts[codes > 0])
    train = freq[1:].sum()
    present = float(freq[1:][mapped[1:] > 0].sum() / train) if train else 0.0
    p = freq[1:] / train if train else freq[1:]
    q = mapped[1:] / mapped[1:].sum() if mapped[1:].sum() else mapped[1:]
    return DataMatch(data_known, present, float(np.minimum(p, q).sum()))


def check_data_match(
    vocabulary: dict[str, Any],
    data_item_ids: Sequence[str],
    data_counts: Any,
    fingerprint: dict[str, Any],
    data_format: str | None,
    source: str,
    data_name: str,
    allow_other_data: bool = False,
) -> DataMatch | None:
    """Refuse data that is not ``source``'s training data; None when the fingerprints match.

    Raises:
        OtherDataError: another reader format, or an overlap below :data:`MIN_OVERLAP`,
            unless ``allow_other_data``. The message names both data sets.
    """
    saved = vocabulary.get("fingerprint")
    if same_fingerprint(saved, fingerprint):
        return None
    match = measure(vocabulary["item_ids"], vocabulary.get("item_frequency", []),
                    data_item_ids, data_counts)  # fmt: skip
    if allow_other_data:
        return match
    trained = describe_fingerprint(saved)
    saved_format = vocabulary.get("format")
    way_on = "pass --allow_other_data (SequenceDataModule(allow_other_data=True)) if this is meant"
    if saved_format and data_format and str(saved_format) != str(data_format):
        raise OtherDataError(
            f"{source}: trained on {trained} (format {saved_format}), but the data is "
            f"{data_name} (format {data_format}): another reader format; {way_on}"
        )
    if match.data_known == 0.0:
        raise OtherDataError(
            f"{source}: the data's item ids do not match the checkpoint's: none of the item ids "
            f"of {data_name} is known to it (trained on {trained}); {way_on}"
        )
    if match.low():
        raise OtherDataError(
            f"{source}: trained on {trained}, but the data is {data_name}, which overlaps it "
            f"little: {match.describe()}; {way_on}"
        )
    return match
