"""What a checkpoint stores about its data, and re-encoding loaded data into it.

:class:`CheckpointVocabulary` is a part of ``SequenceDataModule`` (a mixin):
the data's fingerprint (file digests, or the synthetic options), the
vocabulary a checkpoint saves (:meth:`~CheckpointVocabulary.vocabulary_state`)
and the re-encoding of the loaded data into a checkpoint's vocabulary
(:meth:`~CheckpointVocabulary.use_vocabulary`, ``item_vocabulary=``).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from .cache import file_sha256, source_files
from .data_match import OtherDataError, check_data_match
from .splits import LeaveOneOut, SequenceData, check_enough, leave_one_out
from .vocabulary import read_vocabulary, remap_items

__all__ = ["CheckpointVocabulary"]


class CheckpointVocabulary:
    """Checkpoint vocabulary methods of ``SequenceDataModule`` (uses its loading state)."""

    # set and defined by SequenceDataModule
    path: str | None
    dataset: str
    kcore: int
    max_len: int
    synthetic: Any
    _data: SequenceData | None
    _split: LeaveOneOut | None
    _datasets: dict[str, Any]
    _fingerprint: dict[str, Any] | None
    allow_other_data: bool

    if TYPE_CHECKING:

        def _describe(self) -> str: ...

        def _ensure(self) -> tuple[SequenceData, LeaveOneOut]: ...

        def _source(self) -> tuple[Path, str | None]: ...

    def _remap(self, data: SequenceData, checkpoint: str) -> SequenceData:
        """``data`` in the index space of ``checkpoint``'s vocabulary (warns on unknown items)."""
        vocabulary = read_vocabulary(checkpoint)
        if vocabulary is None:
            rank_zero_warn(
                f"{checkpoint}: the checkpoint holds no item vocabulary (saved before "
                "checkpoints stored one): cannot check that the data's item ids are those it "
                "was trained on; items are numbered in their order of first appearance"
            )
            return data
        return self._apply_vocabulary(data, vocabulary, checkpoint)

    def _apply_vocabulary(
        self, data: SequenceData, vocabulary: dict[str, Any], source: str
    ) -> SequenceData:
        item_ids = [str(i) for i in vocabulary["item_ids"]]
        allow = bool(getattr(self, "allow_other_data", False))
        counts = leave_one_out(data).item_frequency  # counted as the checkpoint's
        match = check_data_match(vocabulary, [str(i) for i in data.item_ids], counts,
                                 self.fingerprint(), self.data_format(), source,
                                 self._describe(), allow)  # fmt: skip
        if [str(i) for i in data.item_ids] == item_ids:
            return data
        remapped, report = remap_items(data, item_ids)
        if not len(remapped.items):
            raise OtherDataError(
                f"{source}: the data's item ids do not match the checkpoint's: none of the item "
                f"ids of {self._describe()} is known to it"
            )
        if report.unknown_items:
            rank_zero_warn(report.message(f"{self._describe()} against {source}"))
        if match is not None:
            rank_zero_info(
                f"SequenceDataModule: {self._describe()} is not the data {source} was trained "
                f"on (another fingerprint; {match.describe()}); its item ids are mapped "
                "through the checkpoint's vocabulary"
            )
        return remapped

    def use_vocabulary(self, vocabulary: dict[str, Any], source: str = "checkpoint") -> None:
        """Re-encode the loaded data into ``vocabulary`` (a checkpoint's); no-op if the same.

        Built datasets are dropped, so loaders made afterwards serve the new indices.
        """
        data, split = self._ensure()
        remapped = self._apply_vocabulary(data, vocabulary, source)
        if remapped is data:
            return
        split = leave_one_out(remapped)
        check_enough(remapped, split, self._describe())
        self._data, self._split = remapped, split
        self._datasets.clear()

    def fingerprint(self) -> dict[str, Any]:
        """What the data was read from: file sha256 digests (or the synthetic options)."""
        if self._fingerprint is None:
            if self.path is None and self.dataset == "synthetic":
                self._fingerprint = {"synthetic": asdict(self.synthetic), "kcore": self.kcore}
            else:
                path, _ = self._source()
                files = {str(f.name): file_sha256(f) for f in source_files(path)}
                self._fingerprint = {"source": self._describe(), "files": files,
                                     "kcore": self.kcore}  # fmt: skip
        return dict(self._fingerprint)

    def data_format(self) -> str | None:
        """The reader format of the data (``"synthetic"`` for generated data)."""
        if self.path is None and self.dataset == "synthetic":
            return "synthetic"
        fmt = self._source()[1]
        if fmt is None:
            from .readers import sniff_format

            fmt = sniff_format(self._source()[0])
        return fmt

    def vocabulary_state(self) -> dict[str, Any]:
        """What a checkpoint stores about its data (plain lists: ``weights_only`` loads it).

        ``item_ids`` (raw ids in index order, ``[0] == ""``), ``user_ids``,
        ``item_frequency`` (training counts, a tensor), ``max_len``, ``format``
        and ``fingerprint`` (file digests, counts).
        """
        data, split = self._ensure()
        fmt = self.data_format()
        counts = {"users": data.num_users, "items": data.num_items,
                  "interactions": int(len(data.items))}  # fmt: skip
        return {
            "item_ids": [str(i) for i in data.item_ids],
            "user_ids": [str(u) for u in data.user_ids],
            "item_frequency": torch.from_numpy(split.item_frequency.copy()),
            "max_len": self.max_len,
            "format": fmt,
            "fingerprint": self.fingerprint() | counts,
        }
