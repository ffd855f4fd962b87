"""Which retrieval a ``Recommender`` ranks through: exact (tiled) or a faiss index.

``retrieval="exact"`` scores every item (``bft_lightning.retrieval.topk``'s
tiled path), the default: about as fast as the index up to the crossover
measured in ``results/perf/serving.md``. ``retrieval="faiss"`` ranks through an
:class:`~bft_lightning.retrieval.faiss_index.ItemIndex`: loaded from beside the
checkpoint (``CKPT.faiss``) when one is there and its digest matches the
checkpoint's item table, else built and saved there for the next start.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bft_lightning.models.base import SequentialRecommender
from bft_lightning.retrieval.faiss_index import FaissConfig, ItemIndex

__all__ = ["RETRIEVALS", "check_retrieval", "index_path_for", "open_index"]

RETRIEVALS = ("exact", "faiss")


def check_retrieval(retrieval: object) -> str:
    if retrieval not in RETRIEVALS:
        raise ValueError(f"retrieval must be one of {RETRIEVALS}, got {retrieval!r}")
    return str(retrieval)


def index_path_for(checkpoint: str | Path) -> Path:
    """Where the index of ``checkpoint`` is saved: ``CKPT.faiss`` (and ``CKPT.faiss.json``)."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.name + ".faiss")


def open_index(
    model: SequentialRecommender,
    checkpoint: str | Path | None = None,
    config: FaissConfig | None = None,
    path: str | Path | None = None,
) -> ItemIndex:
    """The model's item index: read from ``path`` (default beside ``checkpoint``) when it
    exists, checked by digest (``StaleIndexError`` when it was built from other
    weights), else built and, when there is a path, saved there."""
    target = Path(path) if path is not None else None
    if target is None and checkpoint is not None:
        target = index_path_for(checkpoint)
    if target is not None and target.exists():
        return ItemIndex.load(target, model)
    index = ItemIndex.build(model, config)
    if target is not None:
        inputs = [] if checkpoint is None else [checkpoint]
        from bft_lightning.utils.outputs import check_output

        try:
            check_output(target, inputs, False, "item index")
            index.save(target)
        except (OSError, ValueError) as err:  # a read-only folder: serve from memory
            print(f"note: item index not saved to {target}: {err}", file=sys.stderr)
    return index
