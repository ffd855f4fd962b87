"""A confidence for each recommendation list: higher means a hit is more likely.

``recommendation_confidence`` is what a Recommender attaches to each list;
the signal functions below are its parts, and the study
``bench/confidence.py`` measures each (``docs/confidence.md``).

- ``precision="off"``: the listed items' softmax mass,
  ``sum_{j in list} exp(s_j - logsumexp_all s)``, a baseline every scoring
  model has.
- ``precision="on"``: the filter's final precision at the predicting position,
  in the units of the state the head scores (``normalised_log_precision``).

Shapes: ``N`` lists of ``k`` items; ``d`` the width; ``G`` precision groups
(``d / G`` contiguous channels each).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from bft_lightning.nn.stats import last_position_gain  # noqa: F401  (one gain, in nn.stats)
from bft_lightning.retrieval import TopK

_LOG_EPS = math.log(1e-30)


def _finite_scores(top: TopK) -> Tensor:
    """(N, k) scores with "no item" (-inf) kept as -inf, float32."""
    return top.scores.float()


def softmax_mass(top: TopK) -> Tensor:
    """(N,) softmax probability of the listed items together, in [0, 1]."""
    lse_list = torch.logsumexp(_finite_scores(top), dim=1)
    return torch.exp(lse_list - top.logsumexp.float()).clamp(0.0, 1.0)


def score_margin(top: TopK) -> Tensor:
    """(N,) score of the first listed item minus that of the last (0 with one item)."""
    s = _finite_scores(top)
    last = torch.where(torch.isfinite(s), s, s[:, :1]).amin(dim=1)  # a missing item: no gap
    return s[:, 0] - last


def plackett_luce_log_prob(top: TopK) -> Tensor:
    """(N,) log-probability that the model's softmax draws the list, in order.

    ``log P = sum_r [s_r - log(sum_all e^s - sum_{q<r} e^{s_q})]``: the list
    drawn without replacement from the softmax over all items (Plackett-Luce).
    Higher: a more certain list. Missing items ("no item") end the list.
    """
    s = _finite_scores(top)
    lse = top.logsumexp.float().unsqueeze(1)
    # log of the mass left before rank r: log(1 - sum_{q<r} p_q), p_q = e^{s_q - lse}
    p = torch.exp(s - lse).nan_to_num(0.0)
    before = torch.cumsum(p, dim=1) - p
    rest = torch.log1p(-before.clamp(max=1 - 1e-7))
    terms = (s - lse) - rest
    return torch.where(torch.isfinite(s), terms, torch.zeros_like(terms)).sum(1)


def gaussian_list_log_prob(mean: Tensor, var: Tensor) -> Tensor:
    """(N,) log-probability that independent Gaussian item scores keep the list's order.

    mean, var: (N, k) score mean and variance of the listed items, best first.
    Each adjacent pair contributes ``log Phi((m_r - m_{r+1}) / sqrt(v_r + v_{r+1}))``
    (the chain of pairwise orderings, the list-distribution uncertainty of
    LiDu, arXiv 2507.23208, with the score distributions given here).
    """
    gap = mean[:, :-1] - mean[:, 1:]
    sd = (var[:, :-1] + var[:, 1:]).clamp_min(1e-12).sqrt()
    z = gap / sd
    ok = torch.isfinite(z)
    log_phi = torch.special.log_ndtr(torch.where(ok, z, torch.zeros_like(z)))
    return torch.where(ok, log_phi, torch.zeros_like(log_phi)).sum(1)


def final_log_precision(log_prec: Tensor) -> Tensor:
    """(N,) mean over groups of the final ``log lambda`` at the predicting position."""
    return log_prec.float().clamp_min(-20.0).mean(dim=-1)


def normalised_log_precision(log_prec: Tensor, norm_scale: Tensor | None) -> Tensor:
    """(N,) final log precision in the units of the normalised state that is scored.

    The final LayerNorm divides the state by its spread ``sigma(h)``, so a
    variance ``1 / lambda`` of ``h`` is ``1 / (lambda sigma^2)`` in the state
    the head scores (the delta rule through a norm): ``mean_g log lambda_g +
    2 log sigma``. ``norm_scale`` (N,) is that ``sigma`` at the predicting
    position, from the forward that made ``log_prec``
    (``SequentialRecommender.last_encoded``); None gives the plain
    ``final_log_precision``.
    """
    out = final_log_precision(log_prec)
    sigma = _norm_scale(norm_scale, len(out))
    return out if sigma is None else out + 2 * sigma.to(out.device).log()


def _norm_scale(norm_scale: Tensor | None, n: int) -> Tensor | None:
    """(n,) ``sigma(h)``, floored, or None; a scale for another number of rows is an error."""
    if norm_scale is None:
        return None
    if norm_scale.shape != (n,):
        raise ValueError(f"norm_scale has shape {tuple(norm_scale.shape)}, expected ({n},)")
    return norm_scale.float().clamp_min(1e-12)


def normalised_score_variance(
    model: nn.Module, log_prec: Tensor, ids: Tensor, norm_scale: Tensor | None
) -> Tensor:
    """(N, k) ``score_variance`` divided by ``sigma(h)^2`` (``norm_scale`` (N,), the final
    norm's own divisor; left out when None)."""
    var = score_variance(model, log_prec, ids)
    sigma = _norm_scale(norm_scale, len(var))
    return var if sigma is None else var / sigma.to(var.device).square().unsqueeze(1)


def score_variance(model: nn.Module, log_prec: Tensor, ids: Tensor) -> Tensor:
    """(N, k) predictive variance of the scores of items ``ids`` (N, k).

    The final state's precision ``lambda_g`` (N, G) taken through the final
    LayerNorm by the delta rule (its scale ``gamma``; the per-user factor
    ``1 / sigma(h)^2`` is left out, as the normalised state ``hidden`` does
    not carry it), then through the dot product with each item embedding:
    ``Var(s_j) = sum_g exp(-log lambda_g) sum_{i in g} (gamma_i e_{j,i})^2``.
    """
    emb = model.item_emb(ids).float()  # type: ignore[operator]  # (N, k, d)
    norm = getattr(model, "final_norm", None)
    gamma = getattr(norm, "weight", None)
    if isinstance(gamma, Tensor):
        emb = emb * gamma.float()
    n, k, d = emb.shape
    g = log_prec.shape[-1]
    per_group = emb.reshape(n, k, g, d // g).square().sum(-1)  # (N, k, G)
    inv_prec = torch.exp(-log_prec.float().clamp(-20.0, 20.0)).unsqueeze(1)  # (N, 1, G)
    return (per_group * inv_prec).sum(-1)


def precision_z_margin(model: nn.Module, log_prec: Tensor, top: TopK) -> Tensor:
    """(N,) gap between the first and last listed scores over its predictive std.

    ``(s_1 - s_k) / sqrt(Var s_1 + Var s_k)``, the variances from
    ``score_variance``: how many standard deviations the list's head stands
    above its tail under the filter's own posterior.
    """
    s = _finite_scores(top)
    valid = torch.isfinite(s)
    last = valid.sum(1).clamp_min(1) - 1  # the last listed item
    rows = torch.arange(len(s), device=s.device)
    ids = torch.stack([top.ids[:, 0], top.ids[rows, last]], dim=1)
    var = score_variance(model, log_prec, ids)
    gap = s[:, 0] - s[rows, last]
    return gap / var.sum(1).clamp_min(1e-12).sqrt()


def recommendation_confidence(
    model: nn.Module, hidden: Tensor, log_prec: Tensor | None, top: TopK,
    norm_scale: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """(N,) float32 confidence of each list, higher = a hit more likely.

    model: the backbone (a ``SequentialRecommender``) whose ``last_encoded``
    made ``hidden`` (N, d), ``log_prec`` (N, G) or None and ``norm_scale`` (N,);
    top: its ranked list for each state.

    ``precision="off"`` (or no ``log_prec``): ``softmax_mass(top)``, the
    listed items' softmax probability.
    ``precision="on"``: ``normalised_log_precision``, the filter's final
    precision at the predicting position in the units of the state the head
    scores (``mean_g log lambda_g + 2 log sigma(h)``, ``sigma`` given as
    ``norm_scale``; without it, the plain mean ``log lambda``). Chosen on
    validation users among the filter's signals; ``docs/confidence.md`` says
    why and what it measured.
    """
    if top.scores.shape[0] != hidden.shape[0]:
        raise ValueError(f"{hidden.shape[0]} states but {top.scores.shape[0]} lists")
    if getattr(model, "precision", "off") != "on" or log_prec is None:
        return softmax_mass(top).float()
    if log_prec.shape[0] != hidden.shape[0]:
        raise ValueError(f"{hidden.shape[0]} states but log_prec for {log_prec.shape[0]}")
    return normalised_log_precision(log_prec, norm_scale).float()
