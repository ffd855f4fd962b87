"""Item vocabularies: what a checkpoint knows of its data, and re-encoding data into it.

A recommendation checkpoint stores the raw item ids in index order (``item_ids[0]
== ""`` is padding), the raw user ids, the training item counts, ``max_len``,
the reader's format and a fingerprint of the data (file digests, counts). Data
loaded against such a checkpoint is re-encoded into the checkpoint's index
space with :func:`remap_items`: the same raw id gets the same index whatever
the order of the file's lines. Items the checkpoint has never seen cannot be
scored; they are dropped from the histories and counted, and users whose
held-out (validation or test) item is one of them are left out and counted,
never silently re-indexed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .splits import SequenceData

__all__ = ["Remap", "VOCABULARY_KEYS", "read_vocabulary", "remap_items"]

VOCABULARY_KEYS = ("item_ids", "user_ids", "item_frequency", "max_len", "format", "fingerprint")


@dataclass(frozen=True)
class Remap:
    """What re-encoding data into a vocabulary changed (all zero: nothing lost).

    Attributes:
        unknown_items: raw ids of the data's items absent from the vocabulary.
        unknown_interactions: interactions with them (dropped from the histories).
        users_left_out: users removed: a held-out item unknown, or no known item.
        eval_users_lost: users evaluated on the data's own ids that no longer are.
    """

    unknown_items: tuple[str, ...]
    unknown_interactions: int
    users_left_out: int
    eval_users_lost: int

    def message(self, source: str) -> str:
        """One line for a warning; empty when nothing was lost."""
        if not self.unknown_items:
            return ""
        shown = ", ".join(repr(i) for i in self.unknown_items[:5])
        more = ", ..." if len(self.unknown_items) > 5 else ""
        return (
            f"{source}: {len(self.unknown_items)} item ids of the data are not in the "
            f"checkpoint's vocabulary ({shown}{more}); their {self.unknown_interactions} "
            f"interactions are dropped from the histories, {self.users_left_out} users are "
            f"left out (a validation or test item unknown, or no known item) and "
            f"{self.eval_users_lost} users of the data are not evaluated"
        )


def remap_items(data: SequenceData, item_ids: Sequence[str]) -> tuple[SequenceData, Remap]:
    """``data`` re-encoded so that item ``item_ids[i]`` has index ``i``.

    Items not in ``item_ids`` are dropped from the sequences. A user with >= 3
    items whose last or second-last item (the test and validation targets) is
    unknown is left out entirely: dropping only the item would shift the
    leave-one-out split onto another target. Users left with no item are left
    out too. ``num_items`` becomes ``len(item_ids) - 1``.
    """
    index = {str(raw): i for i, raw in enumerate(item_ids) if i > 0}
    own = [str(raw) for raw in data.item_ids[1:]]
    lut = np.array([0] + [index.get(raw, 0) for raw in own], dtype=np.int64)
    new = lut[data.items]
    unknown = new == 0
    lengths = data.lengths
    user_of = np.repeat(np.arange(data.num_users), lengths)
    from_end = data.offsets[1:][user_of] - np.arange(len(data.items))  # 1 = the last item
    held_out = (lengths[user_of] >= 3) & (from_end <= 2)
    bad = np.zeros(data.num_users, dtype=bool)
    bad[user_of[held_out & unknown]] = True
    keep = ~unknown & ~bad[user_of]
    kept_lengths = np.bincount(user_of[keep], minlength=data.num_users)
    users = kept_lengths > 0
    kept_lengths = kept_lengths[users]
    remapped = SequenceData(
        items=new[keep],
        offsets=np.concatenate([[0], np.cumsum(kept_lengths)]).astype(np.int64),
        times=None if data.times is None else data.times[keep],
        num_items=len(item_ids) - 1,
        user_ids=data.user_ids[users],
        item_ids=np.array([str(i) for i in item_ids]),
    )
    report = Remap(
        unknown_items=tuple(raw for raw, code in zip(own, lut[1:]) if code == 0),
        unknown_interactions=int(unknown.sum()),
        users_left_out=int((~users).sum()),
        eval_users_lost=int((lengths >= 3).sum() - (kept_lengths >= 3).sum()),
    )
    return remapped, report


def read_vocabulary(path: str | Path) -> dict[str, Any] | None:
    """The vocabulary stored in a recommendation checkpoint; None if it has none.

    Loaded with ``weights_only=True``; a missing or unreadable file raises
    naming it.
    """
    from bft_lightning.utils.checkpoint_format import load_record

    _, record = load_record(path)
    vocabulary = None if record is None else record.vocabulary
    return vocabulary if isinstance(vocabulary, dict) else None
