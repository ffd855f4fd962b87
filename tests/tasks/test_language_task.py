"""LanguageSFT: the losses, a tiny fit whose loss falls, EM/F1 by generation, calibration."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lm_helpers import write_squad_file

from bft_lightning.lm.data.qa import QADataModule, QAPretrainDataModule
from bft_lightning.lm.model import BFTOptions, LlamaConfig, LlamaForCausalLM
from bft_lightning.lm.task import LanguageSFT, token_loss
from bft_lightning.nn.filter import FilterConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread


def test_focal_loss_formula_and_reduction_to_ce() -> None:
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    sel = labels != -100
    ce = F.cross_entropy(logits[sel], labels[sel])
    torch.testing.assert_close(token_loss(logits, labels, "ce"), ce)
    torch.testing.assert_close(token_loss(logits, labels, "focal", gamma=0.0), ce)
    p = logits[sel].softmax(-1).gather(1, labels[sel][:, None]).squeeze(1)
    focal = (-((1 - p) ** 2) * p.log()).mean()
    torch.testing.assert_close(token_loss(logits, labels, "focal", gamma=2.0), focal)
    assert token_loss(logits, labels, "focal", 2.0) < ce
    with pytest.raises(ValueError):
        token_loss(logits, labels, "mse")
    # gamma < 1 with a token predicted with certainty: (1 - p)^gamma's derivative is
    # infinite at p = 1, which gave NaN gradients
    sure = torch.zeros(1, 2, 11)
    sure[0, :, 3] = 200.0
    sure.requires_grad_(True)
    token_loss(sure, torch.tensor([[3, 3]]), "focal", gamma=0.5).backward()
    assert sure.grad is not None and torch.isfinite(sure.grad).all()


def test_a_missing_checkpoint_dir_is_not_silent() -> None:
    with pytest.warns(UserWarning, match="checkpoint_dir '/no/such/dir' does not exist"):
        task = LanguageSFT(
            TINY_CFG,
            checkpoint_dir="/no/such/dir",
            bft=BFTOptions(filter=FilterConfig(precision="on")),
        )
    assert not task.pretrained  # fresh weights are not calibrated as a pretrained model


def _trainer(tmp_path: Path, steps: int, **kw: object) -> L.Trainer:
    return L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        num_sanity_val_steps=0, **kw,
    )  # fmt: skip


class LossLog(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))


def _data(tmp_path: Path, **kw: object) -> QADataModule:
    f = write_squad_file(tmp_path / "s.json", articles=10)
    opts = dict(files=[str(f)], cache_dir=str(tmp_path), tokenizer_vocab_size=300,
                val_groups=2, test_groups=2, batch_size=16, eval_batch_size=32)  # fmt: skip
    opts.update(kw)
    return QADataModule(**opts)  # type: ignore[arg-type]


TINY_CFG = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0)  # fmt: skip


@pytest.mark.parametrize("loss, precision", [("ce", "off"), ("focal", "on"), ("ce", "on")])
def test_tiny_fit_loss_falls_and_em_f1_are_logged(
    tmp_path: Path, loss: str, precision: str
) -> None:
    torch.manual_seed(0)
    dm = _data(tmp_path)
    task = LanguageSFT(TINY_CFG, bft=BFTOptions(filter=FilterConfig(precision=precision)),
        loss=loss, lr=3e-3,
                       max_new_tokens=4)  # fmt: skip
    log = LossLog()
    trainer = _trainer(
        tmp_path, 40, callbacks=[log], val_check_interval=40, check_val_every_n_epoch=None
    )
    trainer.fit(task, dm)
    first, last = sum(log.losses[:5]) / 5, sum(log.losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    metrics = trainer.callback_metrics
    assert {"val/loss", "val/em", "val/f1"} <= set(metrics)
    assert 0.0 <= float(metrics["val/f1"]) <= 1.0
    res = trainer.test(task, dm, verbose=False)[0]
    assert {"test/em", "test/f1", "test/loss"} <= set(res)
    assert len(task.predictions) == len(dm.encoded["test"])


def test_pretrained_bft_is_calibrated_and_exported(tmp_path: Path, hf_checkpoint: Path) -> None:
    dm = _data(tmp_path, tokenizer_path=str(hf_checkpoint))
    task = LanguageSFT(checkpoint_dir=str(hf_checkpoint),
        bft=BFTOptions(filter=FilterConfig(precision="on")),
                       export_dir=str(tmp_path / "export"), generate=False)  # fmt: skip
    trainer = _trainer(tmp_path, 2, limit_val_batches=1)
    trainer.fit(task, dm)
    assert bool(task.calibrated)
    gains = task.calibration_report.median_gain
    assert all(0.9 < g < 0.99 for row in gains for g in row)
    back = LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    # the export is the fine-tuned BFT model, calibrated prior, Q and sill included
    assert back.bft == task.model.bft and back.bft_state_loaded
    ids = next(iter(dm.val_dataloader()))["input_ids"][:2]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, task.model.eval()(ids).logits)
    # fine-tuning it further starts from that state: no second calibration
    again = LanguageSFT(checkpoint_dir=str(tmp_path / "export"), generate=False)
    assert again.model.bft.precision == "on" and bool(again.calibrated)
    # with a gate the export lacks, calibration runs and says what it re-sets
    gated = LanguageSFT(checkpoint_dir=str(tmp_path / "export"), generate=False,
                        bft=BFTOptions(filter=FilterConfig(precision="on",
                            attention_gate="sigmoid")))  # fmt: skip
    assert not bool(gated.calibrated)
    assert "model.prior.log_tau.weight" in gated.model.bft_loaded_keys
    with pytest.warns(UserWarning, match=r"re-sets \d+ BFT tensors loaded from .*calibrate=False"):
        _trainer(tmp_path, 1, limit_val_batches=0).fit(gated, dm)


def test_pretrain_stage_on_plain_text(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 17}" for i in range(3000)))
    f = write_squad_file(tmp_path / "s.json", articles=6)
    dm = QAPretrainDataModule(seq_len=32, files=[str(f)], cache_dir=str(tmp_path),
                              tokenizer_vocab_size=300, val_groups=1, test_groups=1,
                              extra_text_files=[str(text)], batch_size=8)  # fmt: skip
    task = LanguageSFT(TINY_CFG, lr=3e-3)
    log = LossLog()
    trainer = _trainer(
        tmp_path, 30, callbacks=[log], limit_val_batches=2, val_check_interval=30,
        check_val_every_n_epoch=None,
    )  # fmt: skip
    trainer.fit(task, dm)
    assert sum(log.losses[-5:]) < 0.7 * sum(log.losses[:5])
    assert "val/loss" in trainer.callback_metrics and "val/em" not in trainer.callback_metrics


def test_pretrain_stage_reports_examples_left_out(tmp_path: Path) -> None:
    """QA pairs whose answers do not fit are left out of the pretraining text with a
    warning that counts them, not silently."""
    f = write_squad_file(tmp_path / "s.json", articles=6)
    kw = dict(seq_len=32, files=[str(f)], cache_dir=str(tmp_path), tokenizer_vocab_size=300,
              val_groups=1, test_groups=1, qa_pairs=True)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything fits: no warning
        QAPretrainDataModule(**kw).setup("fit")
    with pytest.warns(UserWarning, match=r"pretraining text \(train\): \d+ of \d+ QA/cloze"):
        QAPretrainDataModule(**kw, max_answer_tokens=0).setup("fit")


def test_vocab_mismatch_is_refused(tmp_path: Path) -> None:
    dm = _data(tmp_path)
    small = LlamaConfig(**{**TINY_CFG.__dict__, "vocab_size": 64})
    with pytest.raises(ValueError, match="vocab_size"):
        _trainer(tmp_path, 1).fit(LanguageSFT(small), dm)


def test_needs_a_model() -> None:
    with pytest.raises(ValueError, match="checkpoint_dir"):
        LanguageSFT()


def test_lightning_checkpoint_reloads_with_weights_only(tmp_path: Path) -> None:
    dm = _data(tmp_path)
    task = LanguageSFT(
        TINY_CFG, bft=BFTOptions(filter=FilterConfig(precision="on")), generate=False
    )
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", logger=False, default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(task, dm)
    ckpt = next(tmp_path.rglob("*.ckpt"))
    back = LanguageSFT.load_from_checkpoint(ckpt, weights_only=True)
    x = torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x), task.eval()(x))


def test_generation_leaves_the_evaluation_forwards_statistics(tmp_path: Path) -> None:
    """Callbacks read the filter statistics at batch end; generating answers after the
    evaluation forward must not replace them by those of its last decoding step."""
    from bft_lightning.nn.stats import find_filter_layers, set_recording

    seen: list[tuple[int, int]] = []

    class Probe(L.Callback):
        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dl=0):  # type: ignore[no-untyped-def]
            set_recording(pl_module.model, True)

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dl=0):  # type: ignore[no-untyped-def]
            _, layer = next(find_filter_layers(pl_module.model))
            seen.append(tuple(layer.last_stats.valid.shape) + tuple(batch["input_ids"].shape))
            assert layer.record  # recording is back on after generation

    dm = _data(tmp_path)
    task = LanguageSFT(
        TINY_CFG, bft=BFTOptions(filter=FilterConfig(precision="on")), max_new_tokens=3
    )
    _trainer(tmp_path, 1, callbacks=[Probe()], limit_val_batches=2).validate(task, dm)
    assert seen and all(s[:2] == s[2:] for s in seen), seen  # (B, T) of the forward
