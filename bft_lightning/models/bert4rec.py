"""BERT4Rec (Sun et al., 2019): bidirectional self-attention trained by cloze.

Training masks a random share of the (non-padding) positions with a mask
token (id ``num_items + 1``, with its own embedding and its own prior
precision) and predicts the masked items; every sequence gets at least one
mask. At test time ``[MASK]`` is appended after the history and its output
predicts the next item. The head is BERT's: dense + GELU + LayerNorm, then the
dot product with the shared item embeddings plus an output bias.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bft_lightning.models.base import SequentialRecommender


class BERT4Rec(SequentialRecommender):
    """BERT4Rec with BFT layers (``precision="on"``) or plain layers (``"off"``).

    Args:
        max_len: the longest history the model reads.
        mask_prob: share of positions masked in training (cloze).
        **kwargs: see ``SequentialRecommender``.
    """

    causal = False
    extra_tokens = 1

    def __init__(self, num_items: int, max_len: int = 50, mask_prob: float = 0.2, **kwargs) -> None:
        super().__init__(num_items, max_len, **kwargs)
        if not 0.0 < mask_prob <= 1.0:
            raise ValueError(f"mask_prob must be in (0, 1], got {mask_prob}")
        if max_len < 2:  # the evaluation input is max_len - 1 items and the mask token
            raise ValueError(f"BERT4Rec needs max_len >= 2, got {max_len}")
        self.mask_prob = mask_prob
        self.mask_token = num_items + 1
        d = self.d_model
        self.transform = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
        self.out_bias = nn.Parameter(torch.zeros(num_items + 1))

    def train_view(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
        if batch.get("num_targets") is not None:
            raise ValueError(
                "BERT4Rec trains on cloze-masked whole histories: prefix rows "
                "(train_rows='prefix', one row per target) would mask and train an early "
                "item once per row; use train_rows='user'"
            )
        seq = batch["seq"][:, -self.max_len :]  # (B, L): the most recent L training items
        valid = seq != 0
        masked = (torch.rand(seq.shape, device=seq.device) < self.mask_prob) & valid
        # every sequence with an item gets at least one mask: its last item
        none = ~masked.any(dim=1) & valid.any(dim=1)
        masked[none, -1] = True
        inputs = seq.masked_fill(masked, self.mask_token)
        labels = seq * masked
        times = batch.get("seq_time")
        return inputs, labels, None if times is None else times[:, -self.max_len :]

    def eval_view(self, input_ids: Tensor) -> Tensor:
        mask = torch.full_like(input_ids[:, :1], self.mask_token)
        return torch.cat([input_ids[:, -(self.max_len - 1) :], mask], dim=1)

    def output_transform(self, hidden: Tensor) -> Tensor:
        return self.transform(hidden)

    def output_bias(self, items: Tensor | None) -> Tensor:
        bias = torch.cat([self.out_bias.new_zeros(1), self.out_bias[1:]])
        return bias if items is None else bias[items]
