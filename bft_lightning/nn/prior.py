"""Layer-0 precision priors ``tau`` (``docs/spec.md``, Layer 0: the prior tau).

``tau`` is learned per id as ``exp`` of a log-precision embedding (multiplicative
moves, so Adam moves it at a useful rate), or as ``exp(MLP(embedding))``. The
padding id gets precision 0 (``log tau = -inf``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Self

import torch
from torch import Tensor, nn

from bft_lightning.nn.checks import check_sizes
from bft_lightning.nn.functional import LOG_PREC_MAX, LOG_PREC_MIN, keep_float32_, upcast

PRIOR_INITS = ("constant", "frequency", "frequency_shuffled", "frequency_inverse")


def frequency_log_prior(counts: Tensor, log_c: float) -> Tensor:
    """Empirical-Bayes init: ``log tau_i = log c + log(1 + n_i) - mean_i log(1 + n_i)``.

    An embedding seen ``n_i`` times has variance ~ ``1 / n_i``. The centring keeps
    the mean at ``log c``. ``counts``: (N,), index 0 (padding) is ignored.
    """
    log_n = torch.log1p(counts.double().clamp_min(0))
    centre = log_n[1:].mean() if len(log_n) > 1 else log_n.mean()
    return (log_c + log_n - centre).float()


class PrecisionPrior(nn.Module):
    """Per-id learned layer-0 log-precision, width 1 (one a token) or ``G``.

    Args:
        num_embeddings: vocabulary size including the padding id.
        width: 1 or the number of precision groups ``G``.
        init: ``"constant"`` (``log tau = log c``), ``"frequency"`` or
            ``"frequency_shuffled"`` (a control: the frequency init's values
            permuted across ids by a fixed permutation, so the spread of tau is
            the same but no longer tells rare ids from frequent ones) or
            ``"frequency_inverse"`` (the frequency init mirrored about its mean,
            ``log tau_i = 2 log c - log tau_i^freq``: rare ids start with the
            *highest* precision, the pattern the paper reports its model learns
            for rare items: high prior precision, low Kalman gain).
        scale: ``c``; match it to the input scale, ``1 / mean Var(h0)``.
        counts: (num_embeddings,) id frequencies, needed for ``"frequency"``.
        padding_idx: the id whose precision is 0, or None.
    """

    def __init__(
        self,
        num_embeddings: int,
        width: int = 1,
        init: str = "constant",
        scale: float = 1.0,
        counts: Tensor | None = None,
        padding_idx: int | None = 0,
    ) -> None:
        super().__init__()
        if init not in PRIOR_INITS:
            raise ValueError(f"prior init must be one of {PRIOR_INITS}, got {init!r}")
        if not isinstance(scale, int | float) or scale <= 0 or not math.isfinite(scale):
            raise ValueError(f"prior scale c must be positive and finite, got {scale}")
        check_sizes(num_embeddings=num_embeddings, width=width)
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(
                f"padding_idx must be None or in [0, num_embeddings={num_embeddings}), "
                f"got {padding_idx!r}"
            )
        self.padding_idx, self.width = padding_idx, width
        self.log_tau = nn.Embedding(num_embeddings, width)
        self.reset(init, scale, counts)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Self:
        super()._apply(fn, recurse)
        keep_float32_(self.log_tau, ("weight",))  # log tau ~ 8: bf16 rounds its steps away
        return self

    @torch.no_grad()
    def reset(self, init: str, scale: float, counts: Tensor | None = None) -> None:
        """(Re)initialise ``log tau`` by ``init`` with scale ``c``."""
        log_c = math.log(scale)
        if init == "constant":
            self.log_tau.weight.fill_(log_c)
        else:
            if counts is None or len(counts) != self.log_tau.num_embeddings:
                raise ValueError("init='frequency' needs counts of length num_embeddings")
            per_id = frequency_log_prior(torch.as_tensor(counts), log_c)
            if init == "frequency_inverse":
                per_id = 2.0 * log_c - per_id
            elif init == "frequency_shuffled":
                perm = torch.randperm(len(per_id) - 1, generator=torch.Generator().manual_seed(0))
                per_id = torch.cat([per_id[:1], per_id[1:][perm]])
            self.log_tau.weight.copy_(per_id.unsqueeze(1).expand_as(self.log_tau.weight))

    def forward(self, ids: Tensor) -> Tensor:
        """ids: (B, T) -> log tau (B, T, width), ``-inf`` at the padding id."""
        log_tau = upcast(self.log_tau(ids)).clamp(LOG_PREC_MIN, LOG_PREC_MAX)
        if self.padding_idx is not None:
            log_tau = log_tau.masked_fill((ids == self.padding_idx).unsqueeze(-1), float("-inf"))
        return log_tau


class MLPPrecisionPrior(nn.Module):
    """``log tau = log c + MLP(embedding)`` (B, T, width); the last layer starts at zero.

    Shares statistical strength across ids: a rare id gets the precision its
    embedding implies rather than a table entry it rarely updates.
    """

    def __init__(self, d_model: int, width: int = 1, hidden: int = 64, scale: float = 1.0) -> None:
        super().__init__()
        if not isinstance(scale, int | float) or scale <= 0 or not math.isfinite(scale):
            raise ValueError(f"prior scale c must be positive and finite, got {scale}")
        check_sizes(d_model=d_model, width=width, hidden=hidden)
        self.width, self.log_c = width, math.log(scale)
        last = nn.Linear(hidden, width)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), last)

    def forward(self, embedding: Tensor, valid: Tensor) -> Tensor:
        """embedding: (B, T, d); valid: (B, T) bool -> (B, T, width), -inf where not valid."""
        log_tau = (self.log_c + upcast(self.mlp(embedding))).clamp(LOG_PREC_MIN, LOG_PREC_MAX)
        return log_tau.masked_fill(~valid.unsqueeze(-1), float("-inf"))
