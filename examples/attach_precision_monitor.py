"""Attach ``PrecisionMonitor`` to your own LightningModule.

The model below is a user's own: a tiny next-token model that uses
``BFTEncoder`` where it would use ``torch.nn.TransformerEncoder``. None of
bft-lightning's tasks or data modules are involved; the monitor finds the BFT
layers by itself.

    python examples/attach_precision_monitor.py
    tensorboard --logdir lightning_logs     # HISTOGRAMS and SCALARS tabs, tags bft/...
"""

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from bft_lightning.callbacks import PrecisionMonitor
from bft_lightning.nn import BFTEncoder, BFTEncoderLayer


class NextToken(LightningModule):
    """Predict the next token of a sequence with a causal BFT encoder."""

    def __init__(self, vocab: int = 32, d_model: int = 32, nhead: int = 4, num_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = BFTEncoderLayer(d_model, nhead, dim_feedforward=64, dropout=0.0)
        self.encoder = BFTEncoder(layer, num_layers)  # drop-in for nn.TransformerEncoder
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens), is_causal=True))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def main() -> None:
    torch.manual_seed(0)
    start = torch.randint(0, 32, (1024, 1))
    tokens = (start + torch.arange(16)) % 32  # counting sequences: learnable in a few steps
    data = DataLoader(TensorDataset(tokens), batch_size=32, shuffle=True)

    monitor = PrecisionMonitor()  # logs every 50 steps; the other steps cost nothing
    trainer = Trainer(max_steps=100, callbacks=[monitor], log_every_n_steps=10)
    trainer.fit(NextToken(), data)

    print(f"logged {monitor.num_logged} times to {trainer.log_dir}")
    for tag, value in monitor.last_summary.items():
        if tag.endswith(("gain/mean", "gain/p50")):
            print(f"{tag} = {value:.3f}")


if __name__ == "__main__":
    main()
