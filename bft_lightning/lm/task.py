"""Supervised fine-tuning of a causal LM on QA: cross-entropy or focal loss, EM/F1 by generation.

Batches follow the ``QADataModule`` contract: ``input_ids``, ``attention_mask``,
``labels`` (B, T) with ``labels[t]`` the target of position ``t`` (``-100``
elsewhere), and for evaluation ``prompt_ids`` / ``prompt_mask`` (left-padded)
plus the gold ``answers``. Plain-text batches (``QAPretrainDataModule``) have
no prompts: they train and validate the loss only.

The model is a :class:`~bft_lightning.lm.model.LlamaForCausalLM`, built
from ``config`` (from scratch) or loaded from ``checkpoint_dir`` (a local
Llama-format directory, e.g. TinyLlama). A loaded model with ``precision: on``
is calibrated on the first training batch (:func:`calibrate_precision`) so
BFT starts close to the pretrained model.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from bft_lightning.lm.losses import IGNORE_INDEX, LOSSES, token_loss  # noqa: F401  (old imports)
from bft_lightning.lm.metrics import QAScore
from bft_lightning.lm.model import (
    BFTOptions,
    LlamaConfig,
    LlamaForCausalLM,
    calibrate_precision,
)
from bft_lightning.nn.checks import check_int, check_number
from bft_lightning.nn.stats import paused_recording
from bft_lightning.utils.optim import configure_adamw


class LanguageSFT(L.LightningModule):
    """SFT of a Llama-style LM with BFT layers; EM/F1 of greedy answers.

    Args:
        config: the architecture of a model trained from scratch (ignored with
            ``checkpoint_dir``).
        checkpoint_dir: a local Llama-format directory (``config.json``,
            ``*.safetensors``); nothing is downloaded.
        bft: the BFT options (``BFTOptions``: ``filter: {precision: "on", ...}``,
            the prior, dropout); None takes the options a BFT model exported to
            ``checkpoint_dir`` was saved with, else the defaults (precision off).
            A dict is read by ``BFTOptions.from_dict``, so configs and
            checkpoints written with the flat keys (``bft: {precision: "on"}``)
            still load.
        loss: ``"ce"`` or ``"focal"``.
        focal_gamma: ``gamma`` of the focal loss (0 gives cross-entropy).
        label_smoothing: label smoothing of the cross-entropy (training only; 0: none).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay (not on norms, biases, tau, rho).
        prior_lr_scale: learning-rate multiplier of tau and rho.
        warmup_steps: linear warm-up steps.
        cosine: cosine decay to 0 after warm-up over the run.
        max_new_tokens: greedy answer length at evaluation.
        generate: evaluate EM/F1 by generation (False: loss only).
        calibrate: calibrate a loaded model's precision on the first batch (not
            when all its BFT tensors came from ``checkpoint_dir``: a BFT export).
        target_gain: the median Kalman gain calibration aims at.
        export_dir: after ``fit``, write the model (Llama format, plus the BFT
            options and tensors in files that Llama readers ignore:
            :meth:`LlamaForCausalLM.save_pretrained`) and the data's tokenizer here.
        gradient_checkpointing: recompute each decoder layer in the backward pass
            (needed for BFT at TinyLlama scale: precision on materialises attention).
    """

    calibrated: Tensor

    def __init__(
        self,
        config: LlamaConfig | None = None,
        checkpoint_dir: str | None = None,
        bft: BFTOptions | dict[str, str | int | float | bool | None] | None = None,
        loss: str = "ce",
        focal_gamma: float = 2.0,
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        prior_lr_scale: float = 1.0,
        warmup_steps: int = 0,
        cosine: bool = False,
        max_new_tokens: int = 32,
        generate: bool = True,
        calibrate: bool = True,
        target_gain: float = 0.95,
        export_dir: str | None = None,
        gradient_checkpointing: bool = False,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if config is None and checkpoint_dir is None:
            raise ValueError("give a model config (from scratch) or a checkpoint_dir")
        check_number("focal_gamma", focal_gamma, 0.0)
        check_number("label_smoothing", label_smoothing, 0.0, 1.0, high_open=True)
        if label_smoothing and loss != "ce":
            raise ValueError(f"label_smoothing applies to loss='ce', not {loss!r}")
        for name, value in (("lr", lr), ("weight_decay", weight_decay),
                            ("prior_lr_scale", prior_lr_scale)):  # fmt: skip
            check_number(name, value, 0.0)
        check_int("warmup_steps", warmup_steps, low=0)
        check_int("max_new_tokens", max_new_tokens)
        check_number("target_gain", target_gain, 0.0, 1.0, low_open=True, high_open=True)
        if isinstance(config, dict):  # from hparams of a saved checkpoint
            config = LlamaConfig(**config)
        if isinstance(bft, dict):  # hparams of a saved checkpoint (older ones: flat keys)
            bft = BFTOptions.from_dict(bft)
        loaded = checkpoint_dir is not None and (config is None or Path(checkpoint_dir).is_dir())
        if loaded:
            assert checkpoint_dir is not None
            self.model = LlamaForCausalLM.from_pretrained(checkpoint_dir, bft)
        else:  # from scratch, or reloading a Lightning checkpoint whose source dir is gone
            assert config is not None
            if checkpoint_dir is not None:
                rank_zero_warn(
                    f"LanguageSFT: checkpoint_dir {checkpoint_dir!r} does not exist; the model "
                    "is built from `config` with fresh weights (right when a Lightning "
                    "checkpoint is loaded next, wrong for a fine-tuning run: check the path)"
                )
            self.model = LlamaForCausalLM(config, bft or BFTOptions())
        # plain dicts in hparams (a Lightning checkpoint then loads with weights_only=True);
        # the architecture is kept even for a loaded model, so a checkpoint rebuilds without it
        self.save_hyperparameters(ignore=["config", "bft"])
        self.hparams["config"] = asdict(self.model.config)
        self.hparams["bft"] = self.model.bft.to_dict()
        self.model.model.gradient_checkpointing = gradient_checkpointing
        self.loss_name, self.focal_gamma = loss, focal_gamma
        self.label_smoothing = label_smoothing
        self.lr, self.weight_decay, self.prior_lr_scale = lr, weight_decay, prior_lr_scale
        self.warmup_steps, self.cosine = warmup_steps, cosine
        self.max_new_tokens, self.generate, self.calibrate = max_new_tokens, generate, calibrate
        self.target_gain, self.export_dir = target_gain, export_dir
        self.pretrained = loaded  # a model built from config is never calibrated as pretrained
        # a BFT export's filter state was trained (or calibrated) already
        self.register_buffer("calibrated", torch.tensor(self.model.bft_state_loaded))
        self.val_qa, self.test_qa = QAScore(), QAScore()
        self.predictions: list[dict[str, Any]] = []

    # -- set-up -------------------------------------------------------------------------
    def _tokenizer(self) -> Any:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        return dm.load_tokenizer() if dm is not None and hasattr(dm, "load_tokenizer") else None

    def setup(self, stage: str) -> None:
        tok = self._tokenizer()
        if tok is not None and tok.vocab_size > self.model.config.vocab_size:
            raise ValueError(
                f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                f"{self.model.config.vocab_size}"
            )

    def on_fit_start(self) -> None:
        needs = self.model.bft.precision == "on" and self.pretrained and self.calibrate
        if not needs or bool(self.calibrated):
            return
        loaded = self.model.bft_loaded_keys
        if loaded:  # an export with other BFT options: its tensors are about to be re-set
            rank_zero_warn(
                f"LanguageSFT: calibrating the precision re-sets {len(loaded)} BFT tensors "
                f"loaded from {self.hparams.get('checkpoint_dir')} (e.g. {loaded[0]}), because "
                "the model has BFT tensors that the export lacks; pass calibrate=False to "
                "keep the loaded ones (the others then keep their initial values)"
            )
        batch = next(iter(self.trainer.datamodule.train_dataloader()))  # type: ignore[attr-defined]
        report = calibrate_precision(
            self.model,
            batch["input_ids"].to(self.device),
            batch["attention_mask"].to(self.device),
            self.target_gain,
        )
        self._broadcast_filter_state()
        self.calibrated.fill_(True)
        self.calibration_report = report

    @torch.no_grad()
    def _broadcast_filter_state(self) -> None:
        """Under DDP every rank calibrated on its own batch: take rank 0's values."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if name.startswith("model.prior.") or name.endswith((".rho", ".sill")):
                dist.broadcast(t.data, src=0)

    def on_fit_end(self) -> None:
        if self.export_dir is None or not self.trainer.is_global_zero:
            return
        out = Path(self.export_dir)
        self.model.save_pretrained(out)
        tok = self._tokenizer()
        if tok is not None:
            tok.save(out / "tokenizer.json")

    # -- training -----------------------------------------------------------------------
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids, attention_mask).logits

    def _loss(self, batch: dict[str, Any], kind: str | None = None) -> tuple[Tensor, int]:
        logits = self(batch["input_ids"], batch["attention_mask"])
        n = int((batch["labels"] != IGNORE_INDEX).sum())
        smoothing = self.label_smoothing if kind is None else 0.0  # evaluation: plain CE
        loss = token_loss(
            logits, batch["labels"], kind or self.loss_name, self.focal_gamma, smoothing
        )
        return loss, n

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, n = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for layer in self.model.model.decoder_layers:
            layer.flush_sill()  # keep the sill buffer current (checkpoints, evaluation)

    # -- evaluation ---------------------------------------------------------------------
    @torch.no_grad()
    def answer(self, batch: dict[str, Any]) -> list[str]:
        """Greedy answers to the batch's left-padded prompts, decoded."""
        tok = self._tokenizer()
        if tok is None:
            raise RuntimeError("decoding answers needs a datamodule with load_tokenizer()")
        with paused_recording(self.model):  # callbacks read the evaluation forward's stats
            new = self.model.generate(
                batch["prompt_ids"], batch["prompt_mask"], self.max_new_tokens,
                eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
            )  # fmt: skip
        out = []
        for row in new.tolist():
            if tok.eos_id in row:
                row = row[: row.index(tok.eos_id)]
            out.append(tok.decode(row).strip())
        return out

    def _eval_step(self, batch: dict[str, Any], split: str, metric: QAScore) -> None:
        loss, n = self._loss(batch, "ce")  # evaluation loss is always cross-entropy
        self.log(f"{split}/loss", loss, batch_size=max(n, 1), sync_dist=True)
        if self.generate and "prompt_ids" in batch:
            preds = self.answer(batch)
            metric.update(preds, batch["answers"], batch.get("index"))
            if split == "test":
                self.predictions += [
                    {"id": i, "prediction": p, "answers": a}
                    for i, p, a in zip(batch["ids"], preds, batch["answers"])
                ]

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "val", self.val_qa)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "test", self.test_qa)

    def on_test_epoch_start(self) -> None:
        self.predictions = []

    def _log_qa(self, split: str, metric: QAScore) -> None:
        if metric.rows == 0:
            return
        scores = metric.compute()
        self.log_dict({f"{split}/{k}": v for k, v in scores.items()})
        metric.reset()

    def on_validation_epoch_end(self) -> None:
        if self.generate:
            self._log_qa("val", self.val_qa)

    def on_test_epoch_end(self) -> None:
        if self.generate:
            self._log_qa("test", self.test_qa)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[str]:
        return self.answer(batch)

    # -- optimisation -------------------------------------------------------------------
    def configure_optimizers(self):  # type: ignore[override]
        return configure_adamw(
            self, self.model, self.lr, self.weight_decay, self.prior_lr_scale,
            self.warmup_steps, self.cosine,
        )  # fmt: skip
