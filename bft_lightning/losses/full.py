"""Full-softmax cross-entropy: every item scored for every target (the exact reference).

Materialises the ``(N, num_items + 1)`` logits (and their gradient of the same
size): ``N x items x 4`` bytes each in float32. Use :class:`ChunkedSoftmax`
for the same loss without that matrix.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender

from .base import NoFrequency


class FullSoftmax(NoFrequency):
    """``loss="ce"``: ``cross_entropy(model.score(hidden, log_prec), target)``."""

    def __call__(
        self,
        model: SequentialRecommender,
        hidden: Tensor,
        target: Tensor,
        log_prec: Tensor | None,
    ) -> Tensor:
        return F.cross_entropy(model.score(hidden, log_prec).float(), target)
