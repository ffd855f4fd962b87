"""``AttentionSinkMonitor``: how much attention goes to the first valid position.

Following Gu et al. 2025 ("When attention sink emerges in language models: an
empirical view"), for layer ``l`` and head ``h``:

- ``alpha_1[s, l, h]``: the attention weight on the first valid key, averaged
  over the valid queries of sequence ``s`` (every query can see the first
  key, causal or not); ``alpha1[l, h]`` is its mean over sequences;
- ``Sink_1^eps[l] = mean_{s, h} 1(alpha_1[s, l, h] > eps)``: each sequence's
  sink mass is compared with ``eps`` (0.3 in the paper) before averaging over
  sequences and heads, as in the paper's ``(scores > eps).mean(dim=(0, 1, 2))``
  (thresholding the mean instead would call two sequences at 0.35 and 0.25
  both sinks); the overall ``Sink_1`` averages over every sequence, head and
  monitored layer.

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


def sink_rate(above: Tensor, count: Tensor) -> Tensor:
    """``Sink_1^eps`` per layer from summed counts, (L, H) -> (L,).

    ``above[l, h]``: sequences whose ``alpha_1`` exceeded ``eps``; ``count[l, h]``:
    sequences measured. The fraction over (sequence, head) pairs; NaN for a
    layer with no sequence.
    """
    total = count.sum(-1)
    return torch.where(total > 0, above.sum(-1) / total.clamp_min(1), math.nan)


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
        return {"alpha": empty, "above": empty.clone(), "count": empty.clone()}

    def accumulate(self, batch: Any, stats: Sequence[FilterStats | None]) -> None:
        for i, s in enumerate(stats):
            if s is None or s.attention is None:
                continue
            alpha, has = sink_alpha(s.attention, s.valid)  # (B, H), (B,)
            heads = alpha.shape[1]
            a_sum, count = self.widen("alpha", heads), self.widen("count", heads)
            above = self.widen("above", heads)
            a_sum[i, :heads] += alpha[has].double().sum(0).to(a_sum.device)
            above[i, :heads] += (alpha[has] > self.eps).sum(0).to(above.device, torch.float64)
            count[i, :heads] += has.sum().to(count.device, torch.float64)

    def emit(self, trainer: Trainer, totals: dict[str, Tensor], prefix: str, step: int) -> None:
        count, above = totals["count"].cpu(), totals["above"].cpu()
        alpha1 = totals["alpha"].cpu() / count
        alpha1[count == 0] = math.nan
        sink1 = sink_rate(above, count)
        self.last_alpha1, self.last_sink1 = alpha1, sink1
        overall = float(above.sum() / count.sum()) if count.sum() > 0 else math.nan
        self.last_summary = self._scalars(alpha1, sink1, overall, prefix)
        output.log_scalars(trainer, self.last_summary, step)

    def _scalars(
        self, alpha1: Tensor, sink1: Tensor, overall: float, prefix: str
    ) -> dict[str, float]:
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
            scalars[f"{prefix}/sink1"] = overall
        return scalars
