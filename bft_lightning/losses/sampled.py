"""Sampled softmax with shared negatives and the log-Q correction (``loss="sampled_softmax_logq"``).

Every target row of a batch is scored against one shared candidate set: the
batch's ``N`` targets (in-batch negatives) plus ``K = num_negatives`` items
drawn with replacement from a proposal ``q`` (uniform over the items, or
popularity ``frequency ** alpha``). The logits are one ``(N, N + K)`` product.

Popular items turn up among the candidates far more often than the full
softmax weighs them, so an uncorrected sampled softmax pushes them down too
hard. The log-Q correction subtracts, from every candidate's logit, the log of
the number of times that item is expected among the candidates,
``log(N p(i) + K q(i))`` (``p`` the training target frequency, which the
in-batch candidates follow): the sampled normaliser then estimates the full
one, ``sum_j exp(z_j) / E[count_j] ~ sum_i exp(z_i)``. The correction applies
to the row's own positive as well (it is one of the in-batch candidates).

A candidate that equals the row's target, other than the row's own positive
(another row with the same target, or a sampled draw of it), is an accidental
hit and is masked to ``-inf``: it would otherwise be pushed down as a negative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender

from .base import check_int, check_nonnegative

NEGATIVES = ("uniform", "popularity", "in_batch")


class SampledSoftmax:
    """Shared-negative sampled softmax, log-Q corrected.

    Args:
        num_items: catalogue size (items ``1..num_items``).
        num_negatives: ``K`` sampled negatives shared by the batch (unused with
            ``negatives="in_batch"``).
        negatives: ``"popularity"`` (``q ~ frequency ** alpha``), ``"uniform"``
            or ``"in_batch"`` (the batch's targets only).
        alpha: exponent of the popularity proposal (``popularity_alpha``; 0 is
            uniform over the items seen in training).
        temperature: logits are divided by it before the correction.
        logq: subtract ``log E[count]`` (True; False only to measure its effect).

    The training item frequencies (``set_item_frequency``) give ``p`` and the
    popularity proposal. Without them, ``"uniform"`` and ``"in_batch"`` use the
    batch's own target counts as ``N p(i)``; ``"popularity"`` needs them.
    """

    needs_item_frequency = True

    def __init__(
        self,
        num_items: int,
        num_negatives: int = 100,
        negatives: str = "popularity",
        alpha: float = 1.0,
        temperature: float = 1.0,
        logq: bool = True,
    ) -> None:
        self.num_items = check_int("num_items", num_items, 1)
        self.num_negatives = check_int("num_negatives", num_negatives, 1)
        if negatives not in NEGATIVES:
            raise ValueError(f"negatives must be one of {NEGATIVES}, got {negatives!r}")
        self.negatives, self.alpha = negatives, check_nonnegative("popularity_alpha", alpha)
        self.temperature, self.logq = temperature, logq
        self.frequency: Tensor | None = None  # (num_items + 1,) training counts
        self._cdf: Tensor | None = None  # popularity proposal, cumulative over items 0..V

    # -- the proposal -------------------------------------------------------------------
    def set_item_frequency(self, frequency: Tensor) -> None:
        """Training counts ``(num_items + 1,)``, index 0 the padding (ignored)."""
        freq = torch.as_tensor(frequency).double().flatten()
        if len(freq) != self.num_items + 1:
            raise ValueError(
                f"item_frequency has {len(freq)} entries, need num_items + 1 = "
                f"{self.num_items + 1} (index 0 the padding)"
            )
        if bool((freq < 0).any()) or not bool(torch.isfinite(freq).all()):
            raise ValueError("item_frequency must hold finite counts >= 0")
        freq[0] = 0.0
        if float(freq.sum()) <= 0:
            raise ValueError("item_frequency is all zero: no item to sample")
        self.frequency, self._cdf = freq, None

    def _frequency(self, device: torch.device) -> Tensor:
        if self.frequency is None:
            raise ValueError(
                "negatives='popularity' samples by training item frequency, and none was "
                "given (the data module has no item_frequency): use negatives='uniform'"
            )
        if self.frequency.device != device:
            self.frequency, self._cdf = self.frequency.to(device), None
        return self.frequency

    def proposal(self, device: torch.device) -> Tensor:
        """``q`` over items ``0..num_items`` (``q[0] = 0``), float64."""
        if self.negatives == "uniform":
            q = torch.full((self.num_items + 1,), 1.0 / self.num_items, device=device)
            q[0] = 0.0
            return q.double()
        freq = self._frequency(device)
        weight = torch.where(freq > 0, freq.pow(self.alpha), torch.zeros_like(freq))
        return weight / weight.sum()

    def sample(self, k: int, device: torch.device) -> Tensor:
        """``k`` item ids drawn with replacement from the proposal."""
        if self.negatives == "uniform":
            return torch.randint(1, self.num_items + 1, (k,), device=device)
        if self._cdf is None or self._cdf.device != device:
            self._cdf = torch.cumsum(self.proposal(device), 0)
        cdf = self._cdf
        u = torch.rand(k, dtype=cdf.dtype, device=device) * cdf[-1]
        return torch.searchsorted(cdf, u, right=True).clamp_(1, self.num_items)

    def log_expected_count(self, candidates: Tensor, target: Tensor, k: int) -> Tensor:
        """``log(N p(i) + K q(i))`` of each candidate item, ``(M,)`` float64."""
        n = len(target)
        if self.frequency is not None:
            freq = self._frequency(target.device)
            in_batch = n * freq[candidates] / freq.sum()
        else:  # the batch's own target counts
            counts = torch.bincount(target, minlength=self.num_items + 1).double()
            in_batch = counts[candidates]
        expected = in_batch
        if k:
            expected = expected + k * self.proposal(target.device)[candidates]
        return torch.log(expected.clamp_min(1e-30))

    # -- the loss -----------------------------------------------------------------------
    def __call__(
        self,
        model: SequentialRecommender,
        hidden: Tensor,
        target: Tensor,
        log_prec: Tensor | None,
    ) -> Tensor:
        k = 0 if self.negatives == "in_batch" else self.num_negatives
        sampled = self.sample(k, target.device) if k else target[:0]
        candidates = torch.cat([target, sampled])  # (M,) = (N + K,)
        h = model.output_transform(hidden)
        weights = model.item_weights()[candidates]  # (M, d)
        logits = (h @ weights.t()).float() + model.output_bias(candidates)  # (N, M)
        scale = model.output_scale(log_prec)
        if scale is not None:
            logits = logits * scale.to(logits.dtype)
        logits = logits / self.temperature
        if self.logq:
            logits = logits - self.log_expected_count(candidates, target, k).to(logits.dtype)
        n = len(target)
        rows = torch.arange(n, device=target.device)
        hit = candidates[None, :] == target[:, None]
        hit[rows, rows] = False  # the row's own positive
        logits = logits.masked_fill(hit, float("-inf"))
        return F.cross_entropy(logits, rows)
