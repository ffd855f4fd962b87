"""The checkpoint format: the ``"bft_lightning"`` record, its reader and its writer.

A recommendation checkpoint is a Lightning checkpoint (``state_dict``,
``hyper_parameters``, loop state) plus one record under
``checkpoint[CHECKPOINT_KEY]`` saying what it holds beside the weights:
which task and backbone it was saved from and how to rebuild the backbone,
the data's vocabulary (raw ids in index order, training counts, reader format,
data fingerprint), whether the data had timestamps, a calibrated confidence,
the share of training targets already in their own history (``repeat_rate``),
and ``sealed``: whether its writer stored a content digest in the file.

This module is the one place that spells the key and the fields.
:class:`CheckpointRecord` is the typed view; :func:`read_record` and
:func:`write_record` convert between it and the plain dict a ``weights_only``
load accepts; :func:`load_checkpoint` is the fail-closed reader (file level:
:mod:`bft_lightning.utils.checkpoint_io`) and :func:`save_checkpoint` the
atomic, sealed writer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINT_KEY",
    "CheckpointRecord",
    "is_sealed",
    "load_checkpoint",
    "load_record",
    "read_record",
    "save_checkpoint",
    "seal",
    "seal_checkpoints",
    "write_record",
]

CHECKPOINT_KEY = "bft_lightning"


@dataclass(frozen=True)
class CheckpointRecord:
    """What a recommendation checkpoint holds beside its weights.

    Attributes:
        task: the LightningModule's class path.
        backbone: the backbone's class path.
        num_items: the item count the weights score.
        max_len: the longest history the model reads.
        backbone_init: ``{"class_path", "init_args"}`` that rebuild the backbone, or None.
        vocabulary: the data's vocabulary (``item_ids``, ``user_ids``, ``item_frequency``,
            ``max_len``, ``format``, ``fingerprint``), or None (saved before it was kept).
        timestamps: whether the training data had timestamps; None: not recorded.
        calibration: the fitted confidence (``serving.hit_calibration``), or None.
        repeat_rate: the share of training targets already in their own history;
            None when the data module did not say (and in older checkpoints).
        sealed: whether the writer stored a content digest in the file. A sealed
            checkpoint without a readable digest is refused (fail closed).
        extra: fields this version does not know (kept on rewrite).
    """

    task: str | None = None
    backbone: str | None = None
    num_items: int | None = None
    max_len: int | None = None
    backbone_init: dict[str, Any] | None = None
    vocabulary: dict[str, Any] | None = None
    timestamps: bool | None = None
    calibration: dict[str, Any] | None = None
    repeat_rate: float | None = None
    sealed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fingerprint(self) -> dict[str, Any] | None:
        """What the training data was read from (file digests or synthetic options, counts)."""
        value = (self.vocabulary or {}).get("fingerprint")
        return value if isinstance(value, dict) else None

    @property
    def data_format(self) -> str | None:
        """The reader format of the training data (``"ml-1m"``, ``"synthetic"``, ...)."""
        value = (self.vocabulary or {}).get("format")
        return None if value is None else str(value)

    def with_calibration(self, calibration: dict[str, Any] | None) -> CheckpointRecord:
        return replace(self, calibration=calibration)


# the stored names of fields whose attribute name differs
_STORED = {"calibration": "confidence"}
_KNOWN = {f.name for f in fields(CheckpointRecord)} - {"extra"}


def read_record(checkpoint: dict[str, Any]) -> CheckpointRecord | None:
    """The record of a loaded checkpoint dict; None when it has none (not ours, or an LM)."""
    raw = checkpoint.get(CHECKPOINT_KEY)
    if not isinstance(raw, dict):
        return None
    values: dict[str, Any] = {}
    for name in _KNOWN:
        values[name] = raw.get(_STORED.get(name, name))
    rate = values["repeat_rate"]
    values["repeat_rate"] = None if rate is None else float(rate)
    values["sealed"] = bool(values["sealed"])
    stored = {_STORED.get(n, n) for n in _KNOWN}
    values["extra"] = {k: v for k, v in raw.items() if k not in stored}
    return CheckpointRecord(**values)


def write_record(checkpoint: dict[str, Any], record: CheckpointRecord) -> None:
    """Store ``record`` in ``checkpoint`` (plain values only; None fields are left out)."""
    out: dict[str, Any] = dict(record.extra)
    for name in _KNOWN:
        value = getattr(record, name)
        if value is not None and not (name == "sealed" and not value):
            out[_STORED.get(name, name)] = value
    checkpoint[CHECKPOINT_KEY] = out


def seal(checkpoint: dict[str, Any]) -> None:
    """Mark a checkpoint with a record as carrying a digest (the writer calls it)."""
    raw = checkpoint.get(CHECKPOINT_KEY)
    if isinstance(raw, dict):
        raw["sealed"] = True


def seal_checkpoints(trainer: Any) -> None:
    """Make ``trainer`` write sealed checkpoints: Lightning's plain local writer is
    replaced by :class:`~bft_lightning.utils.checkpoint_io.AtomicCheckpointIO` (atomic,
    with a digest). A writer the user configured is left alone."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from bft_lightning.utils.checkpoint_io import AtomicCheckpointIO

    strategy = getattr(trainer, "strategy", None)
    if strategy is not None and type(getattr(strategy, "checkpoint_io", None)) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()


def is_sealed(checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint says its writer stored a content digest."""
    raw = checkpoint.get(CHECKPOINT_KEY)
    return isinstance(raw, dict) and bool(raw.get("sealed"))


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """The fail-closed reader: ``weights_only``, digest checked (see ``checkpoint_io``)."""
    from bft_lightning.utils.checkpoint_io import safe_load_checkpoint

    return safe_load_checkpoint(path, map_location)


def load_record(path: str | os.PathLike) -> tuple[dict[str, Any], CheckpointRecord | None]:
    """Load ``path`` (fail closed) and read its record."""
    checkpoint = load_checkpoint(path)
    return checkpoint, read_record(checkpoint)


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``checkpoint`` atomically, sealed with a content digest; returns the path."""
    from bft_lightning.utils.checkpoint_io import atomic_torch_save, content_digest

    seal(checkpoint)
    atomic_torch_save(checkpoint, path, digest=content_digest(checkpoint))
    return Path(path)
