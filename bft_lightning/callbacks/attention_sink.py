"""``AttentionSinkMonitor``: how much attention goes to the first valid position.

Following Gu et al. 2025 ("When attention sink emerges in language models: an
empirical view"), for layer ``l`` and head ``h``:

- ``alpha_1[l, h]``: the attention weight on the first valid key, averaged
  over the valid queries of a sequence (every query can see the first key,
  causal or not), then over sequences;
- ``Sink_1^eps[l] = mean_h 1(alpha_1[l, h] > eps)``, the fraction of heads
  whose sink mass exceeds ``eps`` (0.3 in the paper); the overall ``Sink_1``
  is the fraction over every head of every monitored layer.

Padding may be on either side: "first" means the first position with
positive precision. The weights are the layer's attention before dropout: the
kriging weights for a BFT layer, the softmax for ``precision="off"``, so the
same callback compares runs with and without BFT. Per-sequence sums and
counts are summed across ranks, so DDP gives the single-process value.

Logged (``{p}`` = ``sink_val`` or ``sink_test``): ``{p}/L/alpha1/h{a}``,
``{p}/L/alpha1`` (mean over heads), ``{p}/L/sink1``, ``{p}/alpha1``, ``{p}/sink1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from lightning.pytorch import Trainer
from torch import Tensor

from bft_lightning.callbacks import output
from bft_lightning.callbacks.eval_recorder import EvalRecorder
from bft_lightning.nn.stats import FilterStats


def first_valid_index(valid: Tensor) -> Tensor:
    """Index of the first valid position of each sequence, (B, T) bool -> (B,) (0 if none)."""
    return valid.to(torch.uint8).argmax(dim=1)


def sink_alpha(attention: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Per sequence and head, the mean attention of valid queries on the first valid key.

    attention: (B, H, T, T) weights, rows are queries; valid: (B, T).
    Returns alpha (B, H) and which sequences have a valid position (B,).
    """
    b, h, t, _ = attention.shape
    first = first_valid_index(valid).view(b, 1, 1, 1).expand(b, h, t, 1)
    on_first = attention.float().gather(-1, first).squeeze(-1)  # (B, H, T)
    queries = valid.unsqueeze(1).float()  # (B, 1, T)
    alpha = (on_first * queries).sum(-1) / queries.sum(-1).clamp_min(1)  # (B, H)
    return alpha, valid.any(dim=1)


def sink_rate(alpha1: Tensor, eps: float = 0.3) -> Tensor:
    """``Sink_1^eps`` per layer: the fraction of heads with ``alpha_1 > eps``; (L, H) -> (L,).

    NaN entries (heads a layer does not have) are left out.
    """
    present = ~torch.isnan(alpha1)
    sinks = ((alpha1 > eps) & present).sum(-1).float()
    return sinks / present.sum(-1).clamp_min(1)


class AttentionSinkMonitor(EvalRecorder):
    """Sink mass ``alpha_1`` per layer and head, and ``Sink_1^eps``, on eval batches.

    Records the attention weights of the measured batches only
    (``record_attention``), which materialises (B, H, T, T) per layer while
    recording; use ``max_batches`` to bound the cost on long validations.

    Args:
        eps: threshold of ``Sink_1`` (Gu et al. 2025 use 0.3).
        layers: globs on module names or indices into the found layers; None = all.
        stages: ``"validate"`` and / or ``"test"``.
        max_batches: record at most this many batches per epoch; None means all.
        prefix: tag prefix; the stage is appended (``sink_val``, ``sink_test``).
    """

    record_attention: ClassVar[bool | str] = True
    default_prefix: ClassVar[str] = "sink"

    def __init__(
        self,
        eps: float = 0.3,
        layers: list[str | int] | None = None,
        stages: list[str] | None = None,
        max_batches: int | None = None,
        prefix: str | None = None,
    ) -> None:
        super().__init__(layers=layers, stages=stages, max_batches=max_batches, prefix=prefix)
        self.eps = eps
        self.last_alpha1: Tensor | None = None
        self.last_sink1: Tensor | None = None

    def init_sums(self, n_layers: int, device: torch.device) -> dict[str, Tensor]:
        # (layers, heads); the head count is learnt from the first batch
        empty = torch.zeros(n_layers, 0, dtype=torch.float64, device=device)
        return {"alpha": empty, "count": empty.clone()}

    def accumulate(self, batch: Any, stats: Sequence[FilterStats | None]) -> None:
        for i, s in enumerate(stats):
            if s is None or s.attention is None:
                continue
            alpha, has = sink_alpha(s.attention, s.valid)  # (B, H), (B,)
            heads = alpha.shape[1]
            a_sum, count = self.widen("alpha", heads), self.widen("count", heads)
            a_sum[i, :heads] += alpha[has].double().sum(0).to(a_sum.device)
            count[i, :heads] += has.sum().to(count.device, torch.float64)

    def emit(self, trainer: Trainer, totals: dict[str, Tensor], prefix: str, step: int) -> None:
        count = totals["count"].cpu()
        alpha1 = totals["alpha"].cpu() / count
        alpha1[count == 0] = math.nan
        sink1 = sink_rate(alpha1, self.eps)
        self.last_alpha1, self.last_sink1 = alpha1, sink1
        self.last_summary = self._scalars(alpha1, sink1, prefix)
        output.log_scalars(trainer, self.last_summary, step)

    def _scalars(self, alpha1: Tensor, sink1: Tensor, prefix: str) -> dict[str, float]:
        scalars: dict[str, float] = {}
        present = ~torch.isnan(alpha1)
        for i, name in enumerate(self.layer_names):
            if not present[i].any():
                continue
            for a in torch.nonzero(present[i]).flatten().tolist():
                scalars[f"{prefix}/{name}/alpha1/h{a}"] = float(alpha1[i, a])
            scalars[f"{prefix}/{name}/alpha1"] = float(alpha1[i][present[i]].mean())
            scalars[f"{prefix}/{name}/sink1"] = float(sink1[i])
        if present.any():
            scalars[f"{prefix}/alpha1"] = float(alpha1[present].mean())
            scalars[f"{prefix}/sink1"] = float((alpha1[present] > self.eps).float().mean())
        return scalars
