"""``RecommendationWriter``: ``predict`` writes every user's next top-k to a file.

    python -m bft_lightning predict --config X.yaml --ckpt_path best.ckpt

adds one by default (``predictions.csv`` in the log folder); to choose the
file and ``k``::

    --trainer.callbacks+=bft_lightning.serving.RecommendationWriter
    --trainer.callbacks.output=next.jsonl --trainer.callbacks.k=20

Each user's recommendation follows the full history (test item included):
what a product would show next. Rows ``(user, rank, item, score,
confidence)`` with raw ids, written batch by batch to a temporary file that
is renamed at the end (never half-written).

The path is checked before anything runs (:func:`bft_lightning.utils.outputs.check_output`):
never one of the run's inputs (checkpoint, config, data), never a directory or
a missing or read-only folder, and an existing file only with ``overwrite``
(``predict --overwrite``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info

from .rows import RowWriter

__all__ = ["RecommendationWriter", "data_files"]


def data_files(datamodule: object) -> list[str]:
    """The files a data module reads (none for generated data)."""
    source = getattr(datamodule, "_source", None)
    if (
        not callable(source)
        or getattr(datamodule, "path", None) is None
        and (getattr(datamodule, "dataset", None) == "synthetic")
    ):
        return []
    from bft_lightning.datamodules.cache import source_files

    try:
        return [str(f) for f in source_files(source()[0])]
    except (ValueError, OSError):
        return []


class RecommendationWriter(BasePredictionWriter):
    """Write the ``predict`` output of ``SequentialRecommendation`` as raw-id rows.

    Args:
        output: a ``.csv`` or ``.jsonl`` file; None: ``predictions.csv`` in the
            trainer's log folder. Under DDP each rank writes its own
            ``<stem>.rank<r><suffix>``.
        k: items per user, 1..num_items.
        exclude_seen: never recommend an item of the model's input window (the
            user's last ``max_len`` items); None: the checkpoint's default, from how
            often its training data repeats an item (``retrieval.seen_default``).
        overwrite: replace an existing output file (never one of the run's inputs).
    """

    def __init__(
        self,
        output: str | None = None,
        k: int = 10,
        exclude_seen: bool | None = None,
        overwrite: bool = False,
    ) -> None:
        super().__init__(write_interval="batch")
        from bft_lightning.utils.checks import check_bool

        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"RecommendationWriter: k must be an integer >= 1, got {k!r}")
        self.exclude_seen = (
            None if exclude_seen is None
            else check_bool(exclude_seen, "RecommendationWriter: exclude_seen")
        )  # fmt: skip
        self.overwrite = check_bool(overwrite, "RecommendationWriter: overwrite")
        self.output, self.k = output, k
        self._inputs: list[str] = []
        self._replaces = False
        self._rows: RowWriter | None = None
        self._user_ids: Any = None
        self._item_ids: Any = None

    def path(self, trainer: L.Trainer) -> Path:
        """Where this rank writes."""
        path = Path(
            self.output or Path(trainer.log_dir or trainer.default_root_dir) / "predictions.csv"
        )
        if trainer.world_size > 1:
            path = path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}")
        return path

    def protect(self, inputs: list[str]) -> None:
        """Files the run reads: the output may never be one of them."""
        self._inputs = [*self._inputs, *inputs]

    def check(self, trainer: L.Trainer) -> None:
        """Refuse an unsafe output path before anything runs (``check_output``)."""
        from bft_lightning.utils.outputs import check_output

        path = self.path(trainer)
        if self.output is None:  # the run's own folder, made for it
            path.parent.mkdir(parents=True, exist_ok=True)
        inputs = [*self._inputs, str(trainer.ckpt_path or "")]
        inputs += data_files(getattr(trainer, "datamodule", None))
        what = "--trainer.callbacks.output" if self.output is not None else "predict output"
        self._replaces = check_output(path, [i for i in inputs if i], self.overwrite, what)

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer)
        num_items = getattr(pl_module, "num_items", None)
        if not hasattr(pl_module, "predict_k") or num_items is None:
            raise ValueError(
                f"RecommendationWriter writes SequentialRecommendation predictions, not "
                f"{type(pl_module).__name__}'s"
            )
        if self.k > num_items:
            raise ValueError(f"RecommendationWriter: k={self.k} exceeds the {num_items} items")
        sequences = getattr(getattr(trainer, "datamodule", None), "sequences", None)
        if sequences is None:
            raise ValueError(
                "RecommendationWriter needs a DataModule with raw ids (SequenceDataModule)"
            )
        setattr(pl_module, "predict_k", self.k)  # noqa: B010 - read by predict_step
        setattr(pl_module, "predict_exclude_seen", self.exclude_seen)  # noqa: B010
        self._user_ids, self._item_ids = sequences.user_ids, sequences.item_ids
        self._rows = RowWriter(self.path(trainer))

    def write_on_batch_end(  # type: ignore[override]
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        assert self._rows is not None
        users = prediction["user"].cpu().numpy()
        items = prediction["items"].cpu().numpy()
        scores = prediction["scores"].float().cpu().numpy()
        confidence = prediction["confidence"].float().cpu().numpy()
        for r, user in enumerate(users):
            valid = items[r] > 0
            self._rows.write(
                str(self._user_ids[user]), [str(i) for i in self._item_ids[items[r][valid]]],
                scores[r][valid].tolist(), float(confidence[r]),
            )  # fmt: skip

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._rows is not None:
            from bft_lightning.callbacks.summary import finish_progress_bar

            path = self._rows.commit()
            finish_progress_bar(trainer, pl_module, "predict")  # this line after the bar
            replaced = " (replaced the existing file: --overwrite)" if self._replaces else ""
            rank_zero_info(
                f"RecommendationWriter: wrote {self._rows.rows} rows to {path}{replaced}"
            )
            self._rows = None

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if self._rows is not None:
            self._rows.abort()
            self._rows = None
