"""A user's own minimal LightningModule around ``BFTEncoder`` (none of our tasks), and data.

Batches are dicts like the project's eval batches: ``input_ids`` (B, T) left-padded
item ids (0 = padding), ``target`` (B,), ``history_len`` (B,).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from bft_lightning.nn import BFTEncoder, BFTEncoderLayer, FilterStats

FAST = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


class ToyBFT(LightningModule):
    """Next-item prediction with a causal BFT encoder (d=16, 2 heads)."""

    def __init__(
        self,
        vocab: int = 24,
        d: int = 16,
        layers: int = 2,
        precision: str = "on",
        gate: str | None = None,
        lr: float = 0.05,
        sill_momentum: float = 0.01,
        attention_impl: str = "reference",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        layer = BFTEncoderLayer(
            d, 2, dim_feedforward=32, dropout=0.0, precision=precision,
            attention_gate=gate, sill_momentum=sill_momentum, attention_impl=attention_impl,
        )  # fmt: skip
        self.encoder = BFTEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)
        self.lr = lr

    def forward(self, ids: Tensor) -> Tensor:
        h = self.encoder(self.emb(ids), src_key_padding_mask=ids == 0, is_causal=True)
        return self.head(h)  # (B, T, V)

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self(batch["input_ids"])[:, -1]  # left padding: the last position is valid
        return F.cross_entropy(logits, batch["target"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LazyToy(ToyBFT):
    """Builds its encoder in ``configure_model``, which Lightning calls after callback setup."""

    def __init__(self) -> None:
        super().__init__()
        del self.encoder

    def configure_model(self) -> None:
        if not hasattr(self, "encoder"):
            layer = BFTEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
            self.encoder = BFTEncoder(layer, 2)


def make_batch(batch_size: int = 4, length: int = 10, vocab: int = 24, seed: int = 0) -> dict:
    """Left-padded random sequences of lengths 1..length."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, length + 1, (batch_size,), generator=g)
    lens[0] = length
    ids = torch.randint(1, vocab, (batch_size, length), generator=g)
    ids[torch.arange(length) < (length - lens)[:, None]] = 0
    target = torch.randint(1, vocab, (batch_size,), generator=g)
    return {"input_ids": ids, "target": target, "history_len": lens}


def make_batches(n: int, seed: int = 0, **kw: int) -> list[dict]:
    return [make_batch(seed=seed + i, **kw) for i in range(n)]


class Batches(Dataset):
    """Each item is a whole batch (use with ``DataLoader(..., batch_size=None)``)."""

    def __init__(self, batches: list[dict]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        return self.batches[i]


def loader(batches: list[dict]) -> DataLoader:
    return DataLoader(Batches(batches), batch_size=None)


class RankBatches(LightningDataModule):
    """Rank ``r`` of ``w`` gets batches ``r::w``; one process gets them all, in the same order.

    With ``use_distributed_sampler=False`` the batches of a DDP run are exactly
    the batches of a single-process run, split between the ranks.
    """

    def __init__(self, train: list[dict], val: list[dict], item_frequency: Tensor | None = None):
        super().__init__()
        self.train, self.val = train, val
        if item_frequency is not None:
            self.item_frequency = item_frequency

    def _mine(self, batches: list[dict]) -> DataLoader:
        r, w = self.trainer.global_rank, self.trainer.world_size
        return loader(batches[r::w])

    def train_dataloader(self) -> DataLoader:
        return self._mine(self.train)

    def val_dataloader(self) -> DataLoader:
        return self._mine(self.val)

    def test_dataloader(self) -> DataLoader:
        return self._mine(self.val)


class OneThread(Callback):
    """Single-threaded torch in every (DDP worker) process."""

    def setup(self, trainer, pl_module, stage) -> None:  # type: ignore[no-untyped-def]
        torch.set_num_threads(1)


class ScriptedLayer(nn.Module):
    """A foreign layer that follows the recording protocol with scripted statistics.

    ``script(ids)`` returns ``FilterStats`` fields for a batch of item ids
    (B, T); ``valid`` is ``ids > 0``. Not a ``BFTEncoderLayer``: the callbacks
    must find it by the protocol alone.
    """

    def __init__(self, script, groups: int = 2, heads: int = 2) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.script, self.groups, self.heads = script, groups, heads
        self.record = False
        self.record_attention = False
        self.last_stats: FilterStats | None = None

    def forward(self, ids: Tensor) -> Tensor:
        if self.record:
            b, t = ids.shape
            zeros = torch.zeros(b, t, self.groups)
            fields = dict(
                valid=ids > 0, log_prec=zeros, log_prec_obs=zeros, gain=zeros + 1,
                n_eff=torch.ones(b, t, self.heads), log_prec_post=zeros, jbar=zeros,
                log_prec_out=zeros, q=torch.zeros(self.groups),
            )  # fmt: skip
            fields.update(self.script(ids))
            if not self.record_attention:
                fields["attention"] = None
            self.last_stats = FilterStats.detached(**fields)
        return ids


class ScriptedModule(LightningModule):
    """Eval-only module around scripted layers (one dummy parameter)."""

    def __init__(self, *scripts) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.blocks = nn.ModuleList(ScriptedLayer(s) for s in scripts)
        self.w = nn.Parameter(torch.zeros(1))

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        for block in self.blocks:
            block(batch["input_ids"])

    test_step = validation_step
