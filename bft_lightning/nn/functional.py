"""The filter math of the Bayesian Filtering Transformer as pure functions.

Symbols follow ``docs/spec.md``. Shapes: ``B`` batch, ``T`` positions, ``H``
heads, ``G`` residual groups (``d / G`` channels each), ``F`` FFN width.

Precision is carried as ``log lambda`` in float32. Padding is precision 0
(``log lambda = -inf``) at the module boundary; inside these functions every
tensor stays finite and a boolean ``valid`` mask carries "precision 0", so
that ``torch.where`` never routes a NaN gradient from an unselected branch.

All variances live in *per-channel* units: a group variance is the mean
variance of the group's channels.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

LOG_PREC_MIN = -20.0
LOG_PREC_MAX = 20.0
VAR_FLOOR = 1e-6  # relative to the sill s0^2


def upcast(x: Tensor) -> Tensor:
    """Half-precision tensors to float32; float32 and float64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def clamp_log_prec(log_prec: Tensor, valid: Tensor | None = None) -> Tensor:
    """Clamp ``log lambda`` to [-20, 20]; positions outside ``valid`` become 0.

    The result is finite everywhere (padding is tracked by ``valid``).
    """
    log_prec = upcast(log_prec)
    if valid is not None:
        log_prec = torch.where(valid.unsqueeze(-1), log_prec, torch.zeros_like(log_prec))
    log_prec = torch.nan_to_num(log_prec, nan=0.0, posinf=LOG_PREC_MAX, neginf=LOG_PREC_MIN)
    return log_prec.clamp(LOG_PREC_MIN, LOG_PREC_MAX)


def with_padding(log_prec: Tensor, valid: Tensor) -> Tensor:
    """Restore ``-inf`` (precision 0) at positions outside ``valid``."""
    return log_prec.masked_fill(~valid.unsqueeze(-1), float("-inf"))


def delta_rule_matrix(
    weight: Tensor, out_groups: int, in_groups: int, in_scale: Tensor | None = None
) -> Tensor:
    """Pooled delta-rule matrix of a linear map ``y = W x``.

    ``P[g_out, g_in] = mean_{i in g_out} sum_{k in g_in} (W[i, k] * in_scale[k])^2``
    so that ``s2_out = P @ s2_in`` for independent per-group input variances.
    ``in_scale`` is the diagonal scale of a norm in front of ``W`` (gamma).

    weight: (out, in); returns (out_groups, in_groups), float32.
    """
    w = upcast(weight)
    if in_scale is not None:
        w = w * upcast(in_scale)
    out_dim, in_dim = w.shape
    w2 = w.square().reshape(out_groups, out_dim // out_groups, in_groups, in_dim // in_groups)
    return w2.sum(dim=3).mean(dim=1)


def delta_rule(s2_in: Tensor, p: Tensor) -> Tensor:
    """Propagate per-group variances: ``s2_out[..., g_out] = sum_g_in P[g_out, g_in] s2_in``.

    s2_in: (..., G_in); p: (G_out, G_in); returns (..., G_out).
    """
    return s2_in @ p.t()


def neighbour_log_precision(log_prec: Tensor, norm_sigma: Tensor, p_v: Tensor) -> Tensor:
    """Prior precision of each key's value per head, ``log lambda_bar[j, a]``.

    ``s2_v[j, a] = sum_g P_V[a, g] / (lambda[j, g] * sigma1_j^2)`` (delta rule
    through Norm1, whose denominator ``sigma1`` divides the variance, and W_V
    with gamma1 folded into ``P_V``); ``lambda_bar = 1 / s2_v``.

    log_prec: (B, T, G) finite; norm_sigma: (B, T); p_v: (H, G).
    Returns (B, H, T).
    """
    s2_h = torch.exp(-log_prec) / upcast(norm_sigma).square().unsqueeze(-1)  # (B, T, G)
    s2_v = delta_rule(s2_h, p_v).clamp_min(torch.finfo(torch.float32).tiny)  # (B, T, H)
    return (-torch.log(s2_v)).transpose(1, 2)


def mask_weights(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as 0 / 1 in ``dtype``, read as bytes.

    PyTorch's CPU kernels for bool tensors are slow next to the float ones
    (casts, ``masked_fill``, ``where``, ``any``; timings in ``results/perf/notes.md``).
    While traced (the ONNX export), a plain cast: the same values, and an op every
    exporter has (a dtype-reinterpreting view is not).
    """
    if torch.jit.is_tracing() or torch.compiler.is_exporting():
        return allowed.to(dtype)
    return allowed.view(torch.uint8).to(dtype)


def mask_bias(allowed: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A bool mask (..., S) as an additive bias (0 allowed, -1e30 blocked) and each
    row's has-key flag (..., 1) as 0 / 1, both in ``dtype`` (:func:`mask_weights`).
    Added to scores, the bias gives -1e30 exactly for |s| < 2^75 (not for float16,
    whose range ends at 65504)."""
    ok = mask_weights(allowed, dtype)
    has_key = ok.sum(dim=-1, keepdim=True).clamp_max_(1.0)
    return ok.sub_(1.0).mul_(1e30), has_key


def masked_softmax(scores: Tensor, allowed: Tensor) -> Tensor:
    """Softmax over the last dim in which rows with no allowed entry give all zeros.

    scores: (..., T_k) float; allowed: broadcastable bool. No NaN anywhere, in
    values or gradients, for finite scores: blocked entries get -1e30 added
    (their weights underflow to exactly 0, as with a fill of -inf, for |s| <
    2^75) and an empty row, uniform then, is zeroed. The mask enters as floats
    (:func:`mask_weights`); float16, whose range ends at 65504, takes the fill.
    """
    if scores.dtype == torch.float16:
        has_key = allowed.any(dim=-1, keepdim=True)
        p = torch.softmax(scores.masked_fill(~(allowed | ~has_key), float("-inf")), dim=-1)
        return p * has_key.to(p.dtype)
    bias, has_key = mask_bias(allowed, scores.dtype)
    return torch.softmax(scores + bias, dim=-1) * has_key


def kish_n_eff(sum_p_sq: Tensor) -> Tensor:
    """Kish effective sample size ``n_eff = 1 / sum_j p_j^2``; 0 for empty rows."""
    has = sum_p_sq > 0
    return torch.where(has, 1.0 / sum_p_sq.clamp_min(1e-30), torch.zeros_like(sum_p_sq))


def n_eff_from_lse(lse_2s: Tensor, lse_s: Tensor) -> Tensor:
    """``sum_j p^2 = exp(LSE(2 s) - 2 LSE(s))`` so ``n_eff = exp(2 LSE(s) - LSE(2 s))``.

    For a fused path that only exposes log-sum-exps of the logits.
    """
    return torch.exp(2.0 * lse_s - lse_2s)


def expanded_square_spread(second_moment: Tensor, estimate: Tensor) -> Tensor:
    """Spread of the neighbours around the estimate, per channel, by the expanded square.

    ``S = sum_j p ||v_j||^2 / d_h - ||e||^2 / d_h`` clamped at 0, where
    ``second_moment = sum_j p ||v_j||^2 / d_h``; equals
    ``sum_j p ||v_j - e||^2 / d_h`` when ``sum_j p = 1``.

    second_moment: (B, H, T); estimate: (B, H, T, d_h). Returns (B, H, T) float32.
    """
    e = upcast(estimate)
    return (upcast(second_moment) - e.square().mean(dim=-1)).clamp_min(0.0)


def reml_variance(spread: Tensor, n_eff: Tensor, sill: Tensor, nu0: float = 1.0) -> Tensor:
    """REML residual variance shrunk by a scaled-inverse-chi^2(nu0, s0^2) prior.

    ``sigma2 = (nu0 s0^2 + n_eff S) / (nu0 + n_eff - 1)``: one degree of freedom
    is spent on the mean, so the weighted residual variance is
    ``n_eff S / (n_eff - 1)`` and the prior adds ``nu0`` pseudo-observations.

    spread, n_eff: (B, H, T); sill: (H,). Returns (B, H, T).
    """
    s0 = upcast(sill).view(1, -1, 1)
    num = nu0 * s0 + n_eff * spread
    den = (nu0 + n_eff - 1.0).clamp_min(nu0 if nu0 > 0 else 1e-6)
    return (num / den).clamp_min(VAR_FLOOR * s0)


def observation_log_precision(
    sigma2: Tensor, n_eff: Tensor, has_key: Tensor, p_o: Tensor
) -> Tensor:
    """``log lambda_obs`` per residual group.

    Per head ``lambda_obs[t, a] = n_eff / sigma2`` (precision of a weighted mean
    of ``n_eff`` effective samples); to residual groups through W_O by the delta
    rule ``s2_z[t, g] = sum_a P_O[g, a] / lambda_obs[t, a]``.
    Rows without a valid key are finite here and must be masked by ``has_key``.
    Clamped to [LOG_PREC_MIN, LOG_PREC_MAX] like every log precision
    (``docs/spec.md``, Conventions), as the HSTU layer's is.

    sigma2, n_eff: (B, H, T); has_key: (B, T); p_o: (G, H). Returns (B, T, G).
    """
    s2_head = sigma2 / n_eff.clamp_min(1.0)  # (B, H, T)
    s2_head = torch.where(has_key.unsqueeze(1), s2_head, torch.ones_like(s2_head))
    s2_z = delta_rule(s2_head.transpose(1, 2), p_o)  # (B, T, G)
    lp = -torch.log(s2_z.clamp_min(torch.finfo(torch.float32).tiny))
    return lp.clamp(LOG_PREC_MIN, LOG_PREC_MAX)


def head_observation_log_precision(sigma2: Tensor, n_eff: Tensor, has_key: Tensor) -> Tensor:
    """``log lambda_obs[t, a] = log(n_eff / sigma2)`` per head, in the values' units.

    Rows without a valid key get 0 (finite; mask them by ``has_key``).
    sigma2, n_eff: (B, H, T); has_key: (B, T). Returns (B, H, T).
    """
    tiny = torch.finfo(torch.float32).tiny
    lp = torch.log(n_eff.clamp_min(1.0)) - torch.log(sigma2.clamp_min(tiny))
    return torch.where(has_key.unsqueeze(1), lp, torch.zeros_like(lp))


def keep_float32_(module: torch.nn.Module, names: tuple[str, ...] = ("sill", "rho")) -> None:
    """Put ``module``'s precision-path tensors ``names`` (buffers or parameters) back
    in float32 after a cast to float16 / bfloat16 (``model.to(torch.bfloat16)``,
    Lightning's ``"bf16-true"``); float64 stays float64.

    The running sill moves by ``momentum`` (0.01) of a difference a step, and an
    optimiser step moves ``rho`` or a prior's ``log tau`` (~8) by ~lr: in
    bfloat16 (8-bit mantissa) such steps are below half the spacing of the
    numbers there, so they round away and the value never moves. A parameter
    keeps its identity (its ``.data`` is replaced, as ``Module._apply`` does).
    """
    low = (torch.float16, torch.bfloat16)
    for name in names:
        buf = module._buffers.get(name)
        if buf is not None and buf.dtype in low:
            module._buffers[name] = buf.float()
        param = module._parameters.get(name)
        if param is not None and param.dtype in low:
            param.data = param.data.float()
            if param.grad is not None:
                param.grad = param.grad.float()


def _sill_moments(values: Tensor, valid: Tensor | None) -> Tensor:
    """Per head: the sum and the sum of squares of the valid values, the count N,
    then the per-channel sums (H, d_h) flattened; float64.

    values: (B, H, T, d_h); valid: (B, T) or None (all valid). The sums are
    products of the 0/1 weights with the values as a (B T, H d_h) float64 matrix
    (a view of the in-projection's output, widened): no gather of the valid rows.
    The rows outside ``valid`` are zeroed first, so a non-finite value there
    (``0 * inf = nan`` in the product) changes nothing; with finite values the
    sums are those of the weights alone (exact zeros added). No data-dependent
    branch: ``torch.compile(fullgraph=True)`` traces it.
    """
    b, h, t, dh = values.shape
    f64 = torch.float64
    rows = values.transpose(1, 2).reshape(b * t, h * dh).to(f64)
    if valid is None:
        w = torch.ones(1, b * t, dtype=f64, device=values.device)
    else:
        keep = valid.reshape(b * t, 1)  # any layout (a transposed mask too)
        rows = torch.where(keep, rows, torch.zeros((), dtype=f64, device=rows.device))
        w = keep.to(f64).reshape(1, b * t)
    per_channel = torch.mm(w, rows).view(h, dh)
    per_head_sq = torch.mm(w, rows * rows).view(h, dh).sum(dim=1)
    return torch.cat([per_channel.sum(dim=1), per_head_sq, w.sum().view(1), per_channel.flatten()])


@torch.no_grad()
def update_running_sill_(sill: Tensor, values: Tensor, valid: Tensor, momentum: float) -> None:
    """In place: ``s0^2 <- (1 - m) s0^2 + m Var(v)``, the values' per-head variance.

    ``Var(v) = mean over valid positions of ||v_j - mean v||^2 / d_h``, pooled
    over the batch (like BatchNorm's running statistics: a buffer, never the
    current sequence alone, so causality holds). Under ``torch.distributed``
    the moments are summed over all processes first, so every rank holds the
    sill one process would compute over the global batch (every rank must then
    run its training forwards in step, as DDP does). Fewer than 2 valid
    positions (over all ranks) leave the sill as it is. Branch-free in the
    data (the count selects by ``torch.where``), so it compiles in one graph.
    values: (B, H, T, d_h); valid: (B, T); sill: (H,).
    """
    moments = _sill_moments(values, valid)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(moments)
    h, dh = values.shape[1], values.shape[3]
    n = moments[2 * h]
    enough = n >= 2
    n_safe = torch.where(enough, n, torch.ones_like(n))  # no 0 / 0 in the unselected branch
    mean = moments[2 * h + 1 :].view(h, dh) / n_safe  # (H, d_h)
    var = moments[h : 2 * h] / (n_safe * dh) - mean.square().mean(dim=1)  # (H,)
    moved = torch.lerp(sill, var.clamp_min(0).to(sill.dtype), momentum)
    sill.copy_(torch.where(enough, moved, sill))


def kalman_gain(log_prec: Tensor, log_prec_obs: Tensor, has_obs: Tensor) -> Tensor:
    """``K = lambda_obs / (lambda + lambda_obs) = sigmoid(log lambda_obs - log lambda)``.

    In [0, 1) in exact arithmetic (1.0 in float32 once ``log lambda_obs - log lambda``
    exceeds ~17, which the clamps allow); exactly 0 where a query has no valid key
    (``has_obs`` False).
    Shapes (B, T, G); has_obs (B, T).
    """
    k = torch.sigmoid(log_prec_obs - log_prec)
    return k * has_obs.unsqueeze(-1).to(k.dtype)


def update_log_precision(log_prec: Tensor, log_prec_obs: Tensor, has_obs: Tensor) -> Tensor:
    """Information adds: ``lambda' = lambda + lambda_obs`` (log-add-exp)."""
    updated = torch.logaddexp(log_prec, log_prec_obs)
    return torch.where(has_obs.unsqueeze(-1), updated, log_prec).clamp(LOG_PREC_MIN, LOG_PREC_MAX)


def process_noise(rho: Tensor) -> Tensor:
    """``Q = softplus(rho) >= 0`` per group."""
    return F.softplus(upcast(rho))


def inverse_process_noise(q: float) -> float:
    """``rho`` such that ``softplus(rho) = q``."""
    return math.log(math.expm1(q))


def predict_log_precision(log_prec: Tensor, jbar: Tensor, q: Tensor) -> Tensor:
    """Predict step: ``lambda'' = ((1 + Jbar)^2 / lambda' + Q)^{-1}``, so ``lambda'' <= 1/Q``.

    log_prec, jbar: (B, T, G); q: (G,). Returns (B, T, G), clamped to [-20, 20].
    """
    s2 = (1.0 + upcast(jbar)).square() * torch.exp(-log_prec) + q
    return (-torch.log(s2.clamp_min(torch.finfo(torch.float32).tiny))).clamp(
        LOG_PREC_MIN, LOG_PREC_MAX
    )


def norm_sigma(x: Tensor, eps: float, rms: bool = False, backward: str = "custom") -> Tensor:
    """The norm's own denominator per token: std for LayerNorm, rms for RMSNorm.

    x: (B, T, d). Returns (B, T) float32. ``backward="custom"``: LayerNorm's
    through :func:`layer_norm_sigma` (keeps only ``x``); ``"autograd"``: the
    plain formula (for ``torch.compile``: inductor on CUDA, torch 2.11, returned
    zero gradients through the hand-written Function). Same values and gradients.
    """
    x = upcast(x)
    if rms:
        return torch.sqrt(x.square().mean(dim=-1) + eps)
    if backward == "autograd":
        centred = x - x.mean(dim=-1, keepdim=True)
        return torch.sqrt(centred.square().mean(dim=-1) + eps)
    return layer_norm_sigma(x, float(eps))


@torch.library.custom_op("bft_lightning::layer_norm_sigma", mutates_args=())
def layer_norm_sigma(x: Tensor, eps: float) -> Tensor:
    """``sqrt(Var(x) + eps)`` over the last dim.

    By hand because ``Tensor.var``'s last-dim reduction is slower on CPU,
    and with its own backward so that only ``x`` (which the norm keeps
    anyway) and the (B, T) result are saved: ``d sigma / dx = (x - mean) / (d sigma)``.
    A ``torch.library`` custom op (fake implementation, backward registered), not
    an autograd Function: ``torch.compile`` keeps it in one graph, also with
    ``dynamic=True`` (which traces the float ``eps`` as a symbol).
    """
    centred = x - x.mean(dim=-1, keepdim=True)
    return centred.square_().mean(dim=-1).add_(eps).sqrt_()


@layer_norm_sigma.register_fake
def _(x: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape[:-1])


def _sigma_setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:
    ctx.save_for_backward(inputs[0], output)


def _sigma_grad(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    x, sigma = ctx.saved_tensors
    centred = x - x.mean(dim=-1, keepdim=True)
    return centred * (grad / (sigma * x.shape[-1])).unsqueeze(-1), None


layer_norm_sigma.register_autograd(_sigma_grad, setup_context=_sigma_setup_context)


def scale_groups(x: Tensor, per_group: Tensor) -> Tensor:
    """``x * per_group`` with (B, T, G) broadcast over each group's ``d / G`` channels.

    A broadcast view, not a repeated copy: autograd keeps only the (B, T, G) factor.
    """
    b, t, d = x.shape
    g = per_group.shape[-1]
    return (x.reshape(b, t, g, d // g) * per_group.to(x.dtype).unsqueeze(-1)).reshape(b, t, d)


def expand_groups(per_group: Tensor, d_model: int) -> Tensor:
    """Broadcast (B, T, G) to (B, T, d) (each group covers ``d / G`` channels)."""
    g = per_group.shape[-1]
    return per_group.repeat_interleave(d_model // g, dim=-1)
