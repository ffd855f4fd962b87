"""HSTU (Zhai et al., 2024, "Actions speak louder than words") as a sequential recommender.

Causal HSTU layers (pointwise SiLU attention with a relative position and
time bias, a U gate, one residual, no FFN; see ``bft_lightning.nn.hstu``)
over item embeddings scaled by ``sqrt(d)`` plus learned positions, as the
reference's input preprocessor does. Every position predicts the next item.
Timestamps, when the batch has them (``seq_time`` in training, ``input_time``
in evaluation), feed the time-bucket bias of every layer. The head is the
shared one (final LayerNorm, dot product with the item embeddings); the
reference L2-normalises instead.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from bft_lightning.models.base import SequentialRecommender
from bft_lightning.nn.filter import FilterConfig
from bft_lightning.nn.hstu import HSTUEncoder, HSTULayer


class HSTU(SequentialRecommender):
    """HSTU with BFT layers (``precision="on"``) or plain HSTU layers (``"off"``).

    Args:
        linear_dim: ``d_v`` per head (U and V); None means ``d_model / nhead``.
        attention_dim: ``d_qk`` per head (Q and K); None means ``d_model / nhead``.
        num_buckets: time buckets of the relative attention bias.
        **kwargs: see ``SequentialRecommender``; ``dim_feedforward`` is unused
            (HSTU has no FFN) and ``attention_gate`` must be None (U is the gate).
    """

    causal = True
    uses_timestamps = True

    def __init__(
        self,
        num_items: int,
        max_len: int = 50,
        linear_dim: int | None = None,
        attention_dim: int | None = None,
        num_buckets: int = 128,
        **kwargs,
    ) -> None:
        # read by build_encoder, which the base constructor calls
        self.linear_dim, self.attention_dim = linear_dim, attention_dim
        self.num_buckets = num_buckets
        super().__init__(num_items, max_len, **kwargs)

    def build_encoder(self, config: FilterConfig, num_layers: int) -> nn.Module:
        """HSTU layers (no FFN; their own pointwise attention, so ``attention_impl``
        and ``attention_chunk`` do not apply)."""
        layer = HSTULayer(
            self.d_model, self.nhead, self.max_len, self.linear_dim, self.attention_dim,
            self.dropout, num_buckets=self.num_buckets, config=config,
        )  # fmt: skip
        return HSTUEncoder(layer, num_layers)

    def embedding_scale(self) -> float:
        return math.sqrt(self.d_model)

    def run_encoder(
        self, h0: Tensor, ids: Tensor, times: Tensor | None, last_only: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The HSTU stack over ``h0``, reading the timestamps (or None) in every layer."""
        return self.encoder(
            h0, src_key_padding_mask=ids == 0, is_causal=self.causal,
            log_precision=self.layer0_precision(ids), timestamps=times, return_precision=True,
            last_only=last_only,
        )  # fmt: skip
