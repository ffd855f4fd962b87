"""SASRec (Kang and McAuley, 2018): causal self-attention over the history.

Item embeddings scaled by ``sqrt(d)`` plus learned positions; the output head
is the dot product with the same item embeddings. Every position predicts the
next item during training.
"""

from __future__ import annotations

import math

from bft_lightning.models.base import SequentialRecommender


class SASRec(SequentialRecommender):
    """SASRec with BFT layers (``precision="on"``) or plain layers (``"off"``)."""

    causal = True

    def embedding_scale(self) -> float:
        return math.sqrt(self.d_model)
