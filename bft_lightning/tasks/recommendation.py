"""The sequential-recommendation LightningModule: it wires batch, model, loss and metrics.

A training step encodes the batch and hands the states to the configured loss
(``bft_lightning.losses``: negative sampling lives there); evaluation ranks
every item (``bft_lightning.retrieval``) into a ``RankingMetric``. What a
checkpoint records and how it is checked is ``tasks/checkpoint_checks.py``; the DDP
rescaling of the loss ``tasks/ddp.py``.

The backbone is injected as a callable ``(num_items, max_len) -> model``, so
configs name the backbone and its options while the item count comes from
the data (``LightningCLI`` links ``data.num_items`` and ``data.max_len``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from bft_lightning.losses import LOSSES, batch_loss, build_loss, check_normalization
from bft_lightning.metrics import RankingMetric, write_report
from bft_lightning.models.base import SequentialRecommender
from bft_lightning.models.sasrec import SASRec
from bft_lightning.nn.stats import last_position_gain, set_recording
from bft_lightning.retrieval import ranks_both_ways
from bft_lightning.tasks import checkpoint_checks as ckpt
from bft_lightning.tasks.checkpoint_checks import qualname
from bft_lightning.tasks.ddp import global_mean
from bft_lightning.utils.checkpoint_format import (
    CHECKPOINT_KEY,
    CheckpointRecord,
    read_record,
    seal_checkpoints,
    write_record,
)
from bft_lightning.utils.optim import configure_adamw

__all__ = ["CHECKPOINT_KEY", "SequentialRecommendation", "backbone_spec", "trim_left_padding"]


def _check_options(**values: float) -> None:
    """Finite numbers in range; names the option otherwise."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
    low = {"num_items": 1, "max_len": 1, "num_negatives": 1, "warmup_steps": 0}
    for name, bound in low.items():
        if values[name] < bound or int(values[name]) != values[name]:
            raise ValueError(f"{name} must be an integer >= {bound}, got {values[name]}")
    for name in ("lr", "weight_decay", "prior_lr_scale"):
        if values[name] < 0:
            raise ValueError(f"{name} must be >= 0, got {values[name]}")
    if values["temperature"] <= 0:
        raise ValueError(f"temperature must be > 0, got {values['temperature']}")


def trim_left_padding(batch: dict[str, Tensor], keep_one: bool = False) -> dict[str, Tensor]:
    """Drop leading columns that are padding in every row of the batch.

    Exact for every backbone: positions are counted from the right and padding
    changes no other position's output. ``keep_one`` leaves one padding column
    where there is one (BERT4Rec appends its mask token into it).
    """
    key = "seq" if "seq" in batch else "input_ids"
    ids = batch[key]
    used = (ids != 0).any(dim=0)
    first = int(used.float().argmax()) if bool(used.any()) else ids.shape[1] - 1
    first = max(first - int(keep_one), 0)
    if first == 0:
        return batch
    width = ids.shape[1]
    return {k: v[:, first:] if v.ndim == 2 and v.shape[1] == width else v for k, v in batch.items()}


def _default_backbone(num_items: int, max_len: int) -> SequentialRecommender:
    return SASRec(num_items, max_len)


def compiled_encode(encode: Callable[..., Any]) -> Callable[..., Any]:
    """``encode`` under ``torch.compile`` with dynamic shapes: one graph serves every
    batch size and history length. The ids (and times) go in as fresh contiguous
    tensors, so a trimmed batch's view (its storage offset and strides, which
    change with the trim) does not make the compiler specialise and rebuild."""
    compiled = torch.compile(encode, dynamic=True)

    @functools.wraps(encode)
    def call(ids: Tensor, times: Tensor | None = None) -> Any:
        fresh = ids.clone(memory_format=torch.contiguous_format)
        if times is not None:
            times = times.clone(memory_format=torch.contiguous_format)
        return compiled(fresh, times)

    return call


def backbone_spec(backbone: object, built: type) -> dict[str, Any] | None:
    """``{"class_path", "init_args"}`` that rebuild ``backbone(num_items, max_len)``
    (``bft_lightning.tasks.checkpoint_checks.backbone_spec``), the default factory included."""
    return ckpt.backbone_spec(backbone, built, default=_default_backbone)


class SequentialRecommendation(L.LightningModule):
    """Train and evaluate a sequential recommender with full ranking.

    Args:
        num_items: number of items (linked from the data).
        max_len: history length (linked from the data).
        backbone: ``SASRec``, ``BERT4Rec`` or ``HSTU`` with its options.
        loss: the training loss (``bft_lightning.losses``; see ``docs/losses.md``):
            ``"ce"`` (full softmax, the exact reference and default),
            ``"ce_chunked"`` (the same loss and gradients computed in item
            chunks: memory independent of the catalogue),
            ``"sampled_softmax_logq"`` (in-batch targets plus ``num_negatives``
            ``negatives`` shared by the batch, log-Q corrected),
            ``"sampled_softmax"`` (``num_negatives`` uniform negatives per row,
            no correction: the loss of earlier versions, unchanged) or ``"bce"``
            (``num_negatives`` uniform negatives per row).
        num_negatives: k for the sampled losses.
        temperature: softmax temperature of the sampled softmax losses.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay (not applied to norms, biases, tau, rho).
        prior_lr_scale: learning-rate multiplier of the precision parameters
            (layer-0 tau and rho).
        warmup_steps: linear warm-up steps (0 = none).
        cosine: cosine decay to 0 over the run after warm-up.
        mask_history: the evaluation convention of the unsuffixed metrics
            (``val/ndcg@10``, ``test/hr@10``, what early stopping monitors):
            True excludes the items of the evaluation input (the user's last
            ``max_len`` items before the target; BERT4Rec reads the last
            ``max_len - 1`` of them, then its mask token) from the ranking, as
            the field's published tables do; older items are not in an
            evaluation batch and stay ranked. Both conventions are always
            computed from the same scores: the other one is logged with its
            suffix (``_seen_masked`` when this is False, ``_unmasked`` when
            True). False by default here (a repeat purchase is a legitimate
            target); the shipped configs set True.
        ks: cut-offs of HR@k / NDCG@k.
        report_dir: where test reports go; default the logger's directory.
        compile: compile the backbone's encoder with ``torch.compile`` (dynamic
            shapes: batches are trimmed to their longest history, and one graph
            serves every length). A backbone whose ``attention_impl`` is
            ``"auto"`` (the default) then runs the ``"blockwise"`` kernel, which
            compiles as one graph (``nn.kernels.resolve``); a chosen kernel stays.
        loss_normalization: what a batch's summed loss is divided by:
            ``"rows"`` (default: its count of rows) or ``"targets"`` (its count
            of targets, a per-target mean). With batches of mixed lengths the
            two agree up to a constant, which AdamW ignores. With batches
            bucketed by length (the DataModule's ``bucket_by_length``, its
            default) a per-target mean weighs each target of a batch of short
            histories many times more than one of a batch of long histories
            (up to 50x: rows of 1 against 50 targets); dividing by
            the rows weighs every target alike (how each trained on Amazon
            Beauty: ``results/perf/notes.md``). Every target weighs the same
            except in the epoch's last, smaller batch (``1 / its rows``).
            ``train/loss`` is logged as the per-target mean either way. A
            checkpoint saved before this option existed resumes with
            ``"targets"``, as it was trained.
        loss_chunk: items per chunk of ``"ce_chunked"`` (its memory is about
            ``3 x targets in a batch x loss_chunk`` floats).
        negatives: sampled negatives of ``"sampled_softmax_logq"``:
            ``"popularity"`` (training frequency ``** popularity_alpha``),
            ``"uniform"`` or ``"in_batch"`` (the batch's targets only).
        popularity_alpha: exponent of the popularity proposal.
    """

    def __init__(
        self,
        num_items: int,
        max_len: int = 50,
        backbone: Callable[[int, int], SequentialRecommender] = _default_backbone,
        loss: str = "ce",
        num_negatives: int = 100,
        temperature: float = 1.0,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        prior_lr_scale: float = 1.0,
        warmup_steps: int = 0,
        cosine: bool = False,
        mask_history: bool = False,
        ks: tuple[int, ...] = (1, 5, 10, 20),
        report_dir: str | None = None,
        compile: bool = False,
        loss_normalization: str = "rows",
        loss_chunk: int = 4096,
        negatives: str = "popularity",
        popularity_alpha: float = 1.0,
    ) -> None:
        super().__init__()
        self._prior_initialised = False  # the frequency prior is set by the first fit only
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        self.loss_normalization = check_normalization(loss_normalization)
        _check_options(num_items=num_items, max_len=max_len, num_negatives=num_negatives,
                       temperature=temperature, lr=lr, weight_decay=weight_decay,
                       prior_lr_scale=prior_lr_scale, warmup_steps=warmup_steps)  # fmt: skip
        if not ks or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks):
            raise ValueError(f"ks must be a non-empty list of integers >= 1, got {ks!r}")
        self.criterion = build_loss(
            loss, num_items, num_negatives=num_negatives, temperature=temperature,
            chunk=loss_chunk, negatives=negatives, popularity_alpha=popularity_alpha,
        )  # fmt: skip
        self.save_hyperparameters(ignore=["backbone"])
        self.model = backbone(num_items, max_len)
        self.backbone_spec = backbone_spec(backbone, type(self.model))
        if compile:  # an instance attribute: the state dict and checkpoints are unchanged
            self.model.encode = compiled_encode(self.model.encode)  # type: ignore[method-assign]
        self.loss_name, self.num_negatives, self.temperature = loss, num_negatives, temperature
        self.num_items, self.ks, self.mask_history = num_items, tuple(ks), mask_history
        self.lr, self.weight_decay, self.prior_lr_scale = lr, weight_decay, prior_lr_scale
        self.warmup_steps, self.cosine, self.report_dir = warmup_steps, cosine, report_dir
        self.val_metric: RankingMetric | None = None
        self.test_metric: RankingMetric | None = None
        self.test_results: dict[str, float] = {}

    # -- set-up -------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if stage == "fit" and self._trainer is not None:
            seal_checkpoints(self.trainer)
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        data_items = getattr(dm, "num_items", None)
        if isinstance(data_items, int) and data_items != self.num_items:
            raise ValueError(
                f"the model scores num_items={self.num_items} items but the data has "
                f"{data_items}: evaluate a model on the data (and item ids) it was trained on, "
                "or encode the data in a checkpoint's vocabulary (the DataModule's "
                "item_vocabulary=CKPT; the command line does so for --ckpt_path)"
            )
        freq = self._item_frequency()
        if freq is not None and self.criterion.needs_item_frequency:
            self.criterion.set_item_frequency(freq)  # the data's training counts
        if stage == "fit" and freq is not None and not self._prior_initialised:
            # once: a second fit of the same module continues from the learned prior (a
            # resumed run's checkpoint is loaded after setup, over this init)
            self.model.init_prior_from_frequency(freq)
            self._prior_initialised = True

    def _item_frequency(self) -> Tensor | None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        freq = getattr(dm, "item_frequency", None)
        return None if freq is None else torch.as_tensor(freq)

    def _new_metric(self, loader: object) -> RankingMetric:
        n = len(getattr(loader, "dataset"))  # noqa: B009 - every eval loader has one
        protocol = "seen_masked" if self.mask_history else "unmasked"
        metric = RankingMetric(n, item_frequency=self._item_frequency(), ks=self.ks,
                               protocol=protocol)  # fmt: skip
        return metric.to(self.device)

    # -- training -----------------------------------------------------------------------
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        ids, labels, times = self.model.train_view(trim_left_padding(batch))
        hidden, log_prec = self.model.encode(ids, times)
        out = batch_loss(self.criterion, self.model, hidden, labels, log_prec,
                         self.loss_normalization)  # fmt: skip
        self.log("train/loss", out.mean, prog_bar=True, batch_size=out.targets)
        trainer = self.trainer if self._trainer is not None else None
        return global_mean(out.value, out.divisor, trainer, self.model, times is not None)

    def loss(self, hidden: Tensor, target: Tensor, log_prec: Tensor | None) -> Tensor:
        """hidden: (N, d) states with a label; target: (N,) item ids; the mean loss of
        the configured ``criterion`` (``bft_lightning.losses``)."""
        return self.criterion(self.model, hidden, target, log_prec)

    # -- evaluation ---------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self.val_metric = self._new_metric(self.trainer.val_dataloaders)
        set_recording(self.model, self.model.precision == "on")

    def on_test_epoch_start(self) -> None:
        self.test_metric = self._new_metric(self.trainer.test_dataloaders)
        set_recording(self.model, self.model.precision == "on")

    def _eval_step(self, batch: dict[str, Tensor], metric: RankingMetric | None) -> None:
        assert metric is not None
        batch = trim_left_padding(batch, keep_one=True)
        hidden, log_prec = self.model.last_hidden(batch["input_ids"], batch.get("input_time"))
        # ranks from tiles of the scores, in the weights' precision with autocast off
        # (under mixed precision a bf16 score ties many items with the target, and ties
        # count against it); both conventions from the same tiles: the input's items
        # kept in the ranking, and excluded from it (mask_history picks the headline)
        unmasked, masked = ranks_both_ways(
            self.model, hidden, log_prec, batch["target"], batch["input_ids"]
        )
        ranks, other = (masked, unmasked) if self.mask_history else (unmasked, masked)
        metric.update(
            None, batch["target"], batch["user"], batch.get("history_len"),
            gain=self._last_position_gain(), ranks=ranks, ranks_other=other,
        )  # fmt: skip

    def _last_position_gain(self) -> Tensor | None:
        """Mean Kalman gain over layers and groups at the predicting position, (B,)."""
        return last_position_gain(self.model) if self.model.precision == "on" else None

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.val_metric)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.test_metric)

    def on_validation_epoch_end(self) -> None:
        assert self.val_metric is not None
        self._log_metrics("val", self.val_metric.compute())
        set_recording(self.model, False)

    def on_test_epoch_end(self) -> None:
        assert self.test_metric is not None
        self.test_results = self.test_metric.compute()
        self._log_metrics("test", self.test_results)
        set_recording(self.model, False)
        out = self._report_dir()
        if out is not None and self.trainer.is_global_zero:
            title = f"{type(self.model).__name__} precision={self.model.precision}"
            write_report(self.test_results, out, title, partial=self._partial_test())

    def _partial_test(self) -> str | None:
        """``"k of n test batches"`` when the test saw only part of the users, else None."""
        trainer = self.trainer
        done = sum(int(n) for n in trainer.num_test_batches)
        loaders = trainer.test_dataloaders
        loaders = loaders if isinstance(loaders, list | tuple) else [loaders]
        try:
            full = sum(len(dl) for dl in loaders if dl is not None)
        except TypeError:
            return None
        if getattr(trainer, "fast_dev_run", False) or done < full:
            return f"{done} of {full} test batches (limit_test_batches / fast_dev_run)"
        return None

    def _log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        scalars = {f"{split}/{k}": v for k, v in metrics.items() if math.isfinite(v)}
        self.log_dict(scalars, sync_dist=False, rank_zero_only=False)

    def _report_dir(self) -> Path | None:
        if self.report_dir:
            return Path(self.report_dir)
        if self._trainer is None or self.trainer.logger is None:
            return None  # no logger, no report_dir: nowhere chosen to write to
        log_dir = self.trainer.log_dir
        return Path(log_dir) if log_dir else None

    # -- checkpoints --------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the classes, how to rebuild the backbone and the data's vocabulary.

        ``vocabulary`` (from a DataModule with ``vocabulary_state``, e.g.
        ``SequenceDataModule``): raw item ids in index order, raw user ids,
        training item counts, ``max_len``, the reader's format and a data
        fingerprint; see ``bft_lightning.datamodules.vocabulary``.
        ``timestamps``: whether the data had timestamps (``has_time``), which
        HSTU's time bias read in training; serving then requires them.
        ``repeat_rate``: the share of training targets already in their history
        (``SequenceDataModule.repeat_rate``); recommendations exclude seen items by
        default when it is low.
        """
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        state = getattr(dm, "vocabulary_state", None)
        timed = getattr(dm, "has_time", None)
        rate = getattr(dm, "repeat_rate", None)
        record = CheckpointRecord(
            task=qualname(type(self)),
            backbone=qualname(type(self.model)),
            num_items=self.num_items,
            max_len=int(self.hparams.get("max_len", self.model.max_len)),
            backbone_init=getattr(self, "backbone_spec", None),
            vocabulary=state() if callable(state) else None,
            # trained with timestamps (HSTU's time bias reads them)
            timestamps=timed if isinstance(timed, bool) else None,
            repeat_rate=float(rate) if isinstance(rate, int | float) else None,
        )
        write_record(checkpoint, record)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        source = self.trainer.ckpt_path if self._trainer is not None else None
        self.check_checkpoint(checkpoint, str(source or "checkpoint"))
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        ckpt.use_checkpoint_vocabulary(dm, checkpoint, str(source or "checkpoint"))
        ckpt.check_timestamps(dm, checkpoint, self.model, str(source or "checkpoint"))
        # a calibrated confidence (python -m bft_lightning calibrate) is used by predict;
        # it is not saved again: new weights need a new calibration
        record = read_record(checkpoint)
        self.trained_repeat_rate = None if record is None else record.repeat_rate
        calibration = None if record is None else record.calibration
        if calibration is not None:
            from bft_lightning.serving.hit_calibration import ConfidenceCalibration

            self.confidence_calibration = ConfidenceCalibration.from_dict(
                calibration, str(source or "checkpoint")
            )
        hparams = checkpoint.get("hyper_parameters")
        if isinstance(hparams, dict) and "loss_normalization" not in hparams:
            # saved before the option existed (and "rows" became the default): a resumed
            # run goes on with the per-target mean it was trained with
            self.loss_normalization = "targets"

    # -- prediction ---------------------------------------------------------------------
    predict_k: int = 10  # set by RecommendationWriter
    predict_exclude_seen: bool | None = None  # None: the checkpoint's default
    trained_repeat_rate: float | None = None  # from the checkpoint's record
    confidence_calibration: Any = None  # a serving.hit_calibration.ConfidenceCalibration

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """The top ``predict_k`` items after each row's history (``predict_dataloader``).

        Returns ``user`` (B,) user indices, ``items`` (B, k) item indices (0 where
        fewer than k are eligible), ``scores`` (B, k) and ``confidence`` (B,): the
        checkpoint's calibrated ``P(hit@k)`` when it has one (``calibrate``).
        With ``predict_exclude_seen`` the items of the input window are excluded.
        """
        from bft_lightning.serving.inference import rank_next

        batch = trim_left_padding(batch, keep_one=True)
        ids = batch["input_ids"]
        exclude = ids if self._predict_exclude_seen() else None
        log_count = None
        if self.confidence_calibration is not None:
            freq = self._item_frequency()
            if freq is None:
                raise ValueError("a calibrated confidence needs the data's item counts")
            log_count = torch.log1p(freq.float()).to(ids.device)
        top, confidence = rank_next(self.model, ids, self.predict_k, batch.get("input_time"),
                                    exclude, self.confidence_calibration,
                                    log_count)  # fmt: skip
        return {"user": batch["user"], "items": top.ids, "scores": top.scores,
                "confidence": confidence}  # fmt: skip

    def _predict_exclude_seen(self) -> bool:
        """The writer's choice, else the checkpoint's default (said once, at the first batch)."""
        if self.predict_exclude_seen is None:
            from bft_lightning.retrieval.seen_default import default_exclude_seen

            self.predict_exclude_seen, why = default_exclude_seen(self.trained_repeat_rate)
            rank_zero_info(f"predict: {why} (RecommendationWriter's exclude_seen decides)")
        return bool(self.predict_exclude_seen)

    def check_checkpoint(self, checkpoint: dict[str, Any], source: str = "checkpoint") -> None:
        """Raise a clear ``ValueError`` if ``checkpoint`` cannot be this model's.

        Checks, in order: a Lightning checkpoint with a ``state_dict``; the
        backbone class it was saved from (the same, a subclass or a base); its
        ``num_items`` against this model's (which the data sets); the parameter
        names (unless ``strict_loading`` is off) and shapes; finite values in
        every floating-point tensor (``bft_lightning.tasks.checkpoint_checks``).
        """
        ckpt.check_checkpoint(checkpoint, self.model, self.state_dict(), self.num_items,
                              self.strict_loading, source)  # fmt: skip

    # -- optimisation -------------------------------------------------------------------
    def configure_optimizers(self):  # type: ignore[override]
        return configure_adamw(
            self, self.model, self.lr, self.weight_decay, self.prior_lr_scale,
            self.warmup_steps, self.cosine,
        )  # fmt: skip
