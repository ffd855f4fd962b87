"""A calibrated confidence: the probability that the next item is in the list.

``ConfidenceCalibration`` maps a few per-list features to ``P(the user's next
item is among the first k listed)`` by logistic regression, fit on held-out
users (the validation split, ``python -m bft_lightning calibrate``, or
:meth:`~bft_lightning.serving.Recommender.calibrate`) and stored in the
checkpoint, so that ``Recommendation.confidence`` is a probability a product
can threshold. The features (``confidence_features``) are signals every
scoring model has, plus, for ``precision="on"``, two read from the filter's
state at the predicting position; ``docs/confidence.md`` says which carry
information and how much.

Shapes: ``N`` lists; ``F`` features; ``k`` the calibrated list length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bft_lightning.retrieval import TopK

from .confidence import normalised_log_precision, plackett_luce_log_prob, precision_z_margin

__all__ = [
    "BASE_FEATURES",
    "FILTER_FEATURES",
    "ConfidenceCalibration",
    "confidence_features",
    "feature_names",
    "fit_calibration",
]

BASE_FEATURES = ("softmax_logit", "list_log_prob", "margin", "log_history_len", "last_item_pop")
FILTER_FEATURES = ("filter_z_margin", "filter_log_precision")
_PROB_EPS = 1e-7


def feature_names(precision: str) -> tuple[str, ...]:
    """The features a model of this ``precision`` ("on" / "off") is calibrated on."""
    return BASE_FEATURES + (FILTER_FEATURES if precision == "on" else ())


def _logit(p: Tensor) -> Tensor:
    q = p.clamp(_PROB_EPS, 1 - _PROB_EPS)
    return q.log() - (-q).log1p()


@torch.no_grad()
def confidence_features(
    model: nn.Module,
    log_prec: Tensor | None,
    top: TopK,
    k: int,
    history_len: Tensor,
    last_item: Tensor,
    item_log_count: Tensor,
    norm_scale: Tensor | None = None,
) -> Tensor:
    """(N, F) float64 features of each list, in the order of ``feature_names``.

    top: the first ``k + 1`` (or more) listed items, best first, and the
    log-sum-exp over all items; history_len: (N,) items the model read;
    last_item: (N,) index of the last of them; item_log_count: (num_items + 1,)
    ``log(1 + training count)`` per item.

    - ``softmax_logit``: logit of the first ``k`` items' softmax mass;
    - ``list_log_prob``: their Plackett-Luce log-probability under the softmax
      (the list-distribution uncertainty of LiDu, arXiv 2507.23208);
    - ``margin``: score of rank 1 minus that of rank ``k + 1``;
    - ``log_history_len``, ``last_item_pop``: ``log(1 + len)`` and the last
      item's ``log(1 + training count)``;
    - ``precision="on"`` adds ``filter_z_margin``, the same margin over its
      predictive std under the filter's final precision
      (``precision_z_margin``), and ``filter_log_precision``, the final
      precision in the scored state's units (``normalised_log_precision``,
      with ``norm_scale`` (N,), the final norm's scale from
      ``SequentialRecommender.last_encoded``).
    """
    if top.scores.shape[1] < k + 1:
        raise ValueError(f"confidence features need k + 1 = {k + 1} listed items, "
                         f"got {top.scores.shape[1]}")  # fmt: skip
    head = TopK(scores=top.scores[:, :k], ids=top.ids[:, :k], logsumexp=top.logsumexp)
    tail = TopK(scores=top.scores[:, : k + 1], ids=top.ids[:, : k + 1], logsumexp=top.logsumexp)
    s = top.scores.float()
    lse_head = torch.logsumexp(head.scores.float(), dim=1)
    mass = torch.exp(lse_head - top.logsumexp.float()).clamp(0.0, 1.0)
    gap = s[:, 0] - s[:, k]
    cols = [
        _logit(mass),
        plackett_luce_log_prob(head),
        torch.where(torch.isfinite(gap), gap, torch.zeros_like(gap)),
        torch.log1p(history_len.float()),
        item_log_count.to(last_item.device)[last_item].float(),
    ]
    if getattr(model, "precision", "off") == "on":
        if log_prec is None:
            raise ValueError("a precision='on' model gave no log_prec for its confidence")
        z = precision_z_margin(model, log_prec, tail)
        cols += [torch.where(torch.isfinite(z), z, torch.zeros_like(z)),
                 normalised_log_precision(log_prec, norm_scale)]  # fmt: skip
    return torch.stack([c.double().cpu() for c in cols], dim=1)


@dataclass(frozen=True)
class ConfidenceCalibration:
    """Logistic map from ``confidence_features`` to ``P(next item in the first k)``.

    Attributes:
        k: the list length the probability is for (the calibrated hit@k).
        features: feature names, in column order.
        mean, std: standardisation of each feature (from the fitting users).
        weights, bias: the logistic regression on the standardised features.
        n_users, hit_rate: the fitting users and their hit@k rate.
        auroc: the fitted probability's AUROC for a hit on those users (in-sample).
    """

    k: int
    features: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    n_users: int
    hit_rate: float
    auroc: float

    def __post_init__(self) -> None:
        f = len(self.features)
        if not (isinstance(self.k, int) and self.k >= 1):
            raise ValueError(f"confidence calibration: k must be an integer >= 1, got {self.k!r}")
        for name in ("mean", "std", "weights"):
            values = getattr(self, name)
            if len(values) != f:
                raise ValueError(f"confidence calibration: {name} has {len(values)} values "
                                 f"for {f} features")  # fmt: skip
            if not all(math.isfinite(float(v)) for v in values):
                raise ValueError(f"confidence calibration: {name} holds NaN or inf")
        if not math.isfinite(float(self.bias)):
            raise ValueError("confidence calibration: bias is NaN or inf")
        if any(float(v) <= 0 for v in self.std):
            raise ValueError("confidence calibration: std must be positive")

    def probability(self, x: Tensor) -> Tensor:
        """(N,) float32 ``P(hit@k)`` for (N, F) features."""
        if x.ndim != 2 or x.shape[1] != len(self.features):
            raise ValueError(f"expected (N, {len(self.features)}) features, got "
                             f"{tuple(x.shape)}")  # fmt: skip
        mu, sd, w = (torch.tensor(v, dtype=torch.float64) for v in (self.mean, self.std,
                                                                      self.weights))  # fmt: skip
        z = ((x.double().cpu() - mu) / sd) @ w + self.bias
        return torch.sigmoid(z).float()

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (a checkpoint loaded with ``weights_only=True`` reads it)."""
        return {"k": self.k, "features": list(self.features), "mean": list(self.mean),
                "std": list(self.std), "weights": list(self.weights), "bias": self.bias,
                "n_users": self.n_users, "hit_rate": self.hit_rate,
                "auroc": self.auroc}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "checkpoint") -> ConfidenceCalibration:
        """Rebuild from :meth:`to_dict`; ``ValueError`` naming ``source`` and the field."""
        names = ("k", "features", "mean", "std", "weights", "bias", "n_users", "hit_rate",
                 "auroc")  # fmt: skip
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"{source}: confidence calibration lacks {', '.join(missing)}")
        try:
            return cls(k=int(d["k"]), features=tuple(str(f) for f in d["features"]),
                       mean=tuple(float(v) for v in d["mean"]),
                       std=tuple(float(v) for v in d["std"]),
                       weights=tuple(float(v) for v in d["weights"]), bias=float(d["bias"]),
                       n_users=int(d["n_users"]), hit_rate=float(d["hit_rate"]),
                       auroc=float(d["auroc"]))  # fmt: skip
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: bad confidence calibration: {err}") from None


def _auroc(score: Tensor, hit: Tensor) -> float:
    """Mann-Whitney AUROC of ``score`` for ``hit`` (ties count one half)."""
    pos, n = int(hit.sum()), len(hit)
    if pos == 0 or pos == n:
        return float("nan")
    order = torch.argsort(score)
    ranks = torch.empty(n, dtype=torch.float64)
    s = score[order]
    # mid-ranks over tied scores
    _, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mid = ends - (counts.double() - 1) / 2
    ranks[order] = mid[inverse]
    return float((ranks[hit.bool()].sum() - pos * (pos + 1) / 2) / (pos * (n - pos)))


def fit_calibration(
    x: Tensor, hit: Tensor, features: tuple[str, ...], k: int, l2: float = 1e-3
) -> ConfidenceCalibration:
    """Logistic regression of ``hit`` (N,) on standardised ``x`` (N, F), Newton's method.

    ``l2`` is a ridge on the weights (not the bias), per user. Needs users with
    and without a hit; raises ``ValueError`` saying so otherwise.
    """
    x, y = x.double().cpu(), hit.double().cpu()
    if x.ndim != 2 or x.shape != (len(y), len(features)):
        raise ValueError(f"expected ({len(y)}, {len(features)}) features, got {tuple(x.shape)}")
    pos = int(y.sum())
    if pos == 0 or pos == len(y):
        raise ValueError(
            f"cannot calibrate on {len(y)} users of whom {pos} have a hit@{k}: need users "
            "with and without a hit"
        )
    mu, sd = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-12)
    a = torch.cat([(x - mu) / sd, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
    w = torch.zeros(a.shape[1], dtype=torch.float64)
    ridge = torch.full((a.shape[1],), l2, dtype=torch.float64)
    ridge[-1] = 0.0
    for _ in range(100):
        p = torch.sigmoid(a @ w)
        grad = a.T @ (p - y) / len(y) + ridge * w
        hess = (a * (p * (1 - p)).unsqueeze(1)).T @ a / len(y) + torch.diag(ridge + 1e-9)
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if float(step.abs().max()) < 1e-10:
            break
    prob = torch.sigmoid(a @ w)
    return ConfidenceCalibration(
        k=int(k), features=tuple(features), mean=tuple(mu.tolist()), std=tuple(sd.tolist()),
        weights=tuple(w[:-1].tolist()), bias=float(w[-1]), n_users=len(y),
        hit_rate=pos / len(y), auroc=_auroc(prob, y),
    )  # fmt: skip
