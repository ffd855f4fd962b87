"""HSTU layer and stack (Zhai et al. 2024, "Actions speak louder than words"), run as a BFT filter.

Plain HSTU (``precision="off"``), per layer, multi-head, causal by default:

    x = LN(h)                                   (no affine, eps 1e-6, as the reference)
    U, V, Q, K = split(SiLU(f1(x)))             f1: d -> H (2 d_v + 2 d_qk), no bias
    w[t, j] = SiLU(q_t . k_j + rab[t, j]) / N   over the keys t may see, 0 elsewhere
    A_t = sum_j w[t, j] v_j                     (per head)
    h' = h + f2(dropout(LN(A) * U))             LN over all H d_v channels; no FFN

``N = max_len``, a constant of the layer (the reference divides by its padded
length ``max_sequence_len + 1``, also a constant), so a padded batch gives the
same output as the unpadded one. ``rab`` is a learned bias on the offset
``j - t`` plus, when timestamps are given, a learned bias on the bucket
``floor(ln(max(|ts_t - ts_j|, 1)) / 0.301)`` (clamped to ``num_buckets``). The
reference buckets ``ts_{t+1} - ts_j`` (the query's next action); we use the
query's own time, so the target's timestamp is never an input. The position
term is always on (the reference adds ``rab`` only when it has timestamps).

BFT (``precision="on"``, ``docs/spec.md``, Blocks: HSTU):

1. observe: the prior variance of V per head goes through LN (``1 / sigma1^2``),
   f1 (delta rule, one row per channel) and SiLU (``SiLU'(a)^2`` per channel),
   then is averaged over the head's channels: ``lambda_bar[j, a] = 1 / s2_v``.
   The weights are multiplied by the relative reliability
   ``r[t, j] = lambda_bar_j / mean_{j' <= t, valid} lambda_bar_j'
   = n_t softmax_j(log lambda_bar_j)`` (uniform precision: ``r = 1``, plain HSTU).
2. variance of ``e_t = A_t`` by the sandwich estimator: one extra pass with
   weights ``w^2`` over ``[1, v, ||v||^2 / d_v]`` gives ``S0, S1, S2``;
   ``V_t = sum_j w^2 ||v_j - ebar_t||^2 / d_v`` by the expanded square with
   ``ebar_t = S1 / S0`` (see ``sandwich_variance``). It is shrunk with the
   softmax layer's prior: ``S_t = V_t / S0``, ``n_eff = (sum |w|)^2 / S0``,
   ``sigma2 = (nu0 s0^2 + n_eff S_t) / (nu0 + n_eff - 1)`` (running sill ``s0^2``),
   ``Var(e_t) = sigma2 S0`` per channel. It then moves through LN(A)
   (``1 / sigma_A^2``), the U gate (``U^2`` per channel) and f2 (delta rule):
   ``lambda_obs[t, g] = 1 / s2_y``.
   SiLU weights are signed (about half are negative at init), so ``sum_j w``
   can vanish: the centre is the ``w^2``-weighted mean ``S1 / S0`` (always
   defined; the centre that minimises the sandwich; the ``w``-weighted mean
   when a row's weights are equal) and ``n_eff`` uses ``|w|`` (it equals
   ``(sum w)^2 / sum w^2`` when ``w >= 0``, and lies in ``[1, n_t]``).
3. update: ``K = lambda_obs / (lambda + lambda_obs)``, ``h' = h + K f2(...)``,
   ``lambda' = lambda + lambda_obs``.
4. predict (no FFN, ``Jbar = 0``): ``lambda'' = (1 / lambda' + Q)^{-1} <= 1 / Q``.

Recording (``FilterStats``): ``attention`` holds ``w`` (times ``r`` when on),
unnormalised (rows do not sum to 1); ``n_eff = (sum |w|)^2 / sum w^2``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bft_lightning.nn import functional as BF
from bft_lightning.nn import jacobian as J
from bft_lightning.nn.attention import build_allowed
from bft_lightning.nn.checks import check_dropout, check_heads, check_int, check_number, check_sizes
from bft_lightning.nn.filter import (
    FilterConfig,
    FilterLayer,
    Observation,
    check_groups,
    default_log_precision,
    run_stack,
    valid_positions,
)
from bft_lightning.nn.stats import FilterStats

TINY = torch.finfo(torch.float32).tiny


def time_buckets(timestamps: Tensor, num_buckets: int, queries: int | None = None) -> Tensor:
    """Time buckets ``floor(ln(max(|ts_t - ts_j|, 1)) / 0.301)`` in [0, num_buckets].

    timestamps: (B, T) (e.g. unix seconds). Returns (B, T, T) long, or with
    ``queries`` the rows of the last ``queries`` positions only, (B, queries, T).
    """
    rows = timestamps if queries is None else timestamps[:, -queries:]
    dt = (rows.unsqueeze(2) - timestamps.unsqueeze(1)).abs().double().clamp_min(1.0)
    return (torch.log(dt) / 0.301).long().clamp(0, num_buckets)


def relative_reliability(log_lambda_bar: Tensor, allowed: Tensor) -> Tensor:
    """Relative reliability ``r[t, j] = lambda_bar_j / mean_{j' allowed for t} lambda_bar_j'``.

    Computed as ``n_t softmax_j(log lambda_bar_j)`` over the ``n_t`` allowed keys.
    The mean runs over the keys query ``t`` may see, so causality and padding
    invariance hold; uniform ``lambda_bar`` gives ``r = 1``. 0 where not allowed.
    log_lambda_bar: (B, H, T); allowed: (B, 1, T, T). Returns (B, H, T, T) float32.
    """
    count = BF.mask_weights(allowed, torch.float32).sum(dim=-1, keepdim=True)  # (B, 1, T, 1)
    return BF.masked_softmax(BF.upcast(log_lambda_bar).unsqueeze(-2), allowed) * count


def sandwich_variance(s0: Tensor, s1: Tensor, s2: Tensor, centre: Tensor) -> Tensor:
    """``sum_j w_j^2 ||v_j - c||^2 / d_v`` by the expanded square, clamped at 0.

    With ``S0 = sum w^2``, ``S1 = sum w^2 v``, ``S2 = sum w^2 ||v||^2 / d_v``:
    ``S2 - 2 c . S1 / d_v + ||c||^2 S0 / d_v``.
    s0, s2: (B, H, T); s1, centre: (B, H, T, d_v). Returns (B, H, T).
    """
    dv = s1.shape[-1]
    cross = (centre * s1).sum(dim=-1) / dv
    return (s2 - 2.0 * cross + centre.square().sum(dim=-1) * s0 / dv).clamp_min(0.0)


class RelativeAttentionBias(nn.Module):
    """Relative attention bias, shared by the heads.

    ``rab[t, j] = w_pos[j - t + max_len - 1] + w_time[bucket(|ts_t - ts_j|)]`` (the
    time term only when timestamps are given).
    """

    def __init__(self, max_len: int, num_buckets: int = 128) -> None:
        super().__init__()
        check_sizes(max_len=max_len, num_buckets=num_buckets)
        self.max_len, self.num_buckets = max_len, num_buckets
        self.pos_weight = nn.Parameter(torch.empty(2 * max_len - 1).normal_(0.0, 0.02))
        self.time_weight = nn.Parameter(torch.empty(num_buckets + 1).normal_(0.0, 0.02))

    def forward(self, t: int, timestamps: Tensor | None = None, last_only: bool = False) -> Tensor:
        """Returns (1, T, T), or (B, T, T) with timestamps (B, T); ``last_only``: the
        last query's row only, (1 | B, 1, T)."""
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}")
        pos = torch.arange(t, device=self.pos_weight.device)
        rows = pos[-1:] if last_only else pos
        bias = self.pos_weight[pos.unsqueeze(0) - rows.unsqueeze(1) + self.max_len - 1]  # (Tq, T)
        bias = bias.unsqueeze(0)
        if timestamps is not None:
            if timestamps.shape[-1] != t:
                raise ValueError(f"timestamps {tuple(timestamps.shape)} do not match length {t}")
            buckets = time_buckets(timestamps, self.num_buckets, 1 if last_only else None)
            bias = bias + self.time_weight[buckets]
        return bias


class HSTULayer(FilterLayer):
    """One HSTU layer (pointwise SiLU attention, U gate, one residual), run as a Bayesian filter.

    Args:
        d_model: model width ``d``.
        nhead: heads ``H``.
        max_len: the longest sequence; also the attention's divisor ``N``.
        linear_dim: ``d_v`` per head (U and V); None means ``d / H``.
        attention_dim: ``d_qk`` per head (Q and K); None means ``d / H``.
        dropout: dropout on ``LN(A) * U`` before f2 (the reference's linear dropout).
        num_buckets: time buckets of the relative attention bias.
        layer_norm_eps: epsilon of both layer norms.
        config: how the layer runs as a filter (``FilterConfig``; default: BFT,
            ``precision="on"``). Its ``gain`` must be ``"group"``,
            ``key_precision`` True and no gate; ``attention_impl`` and
            ``attention_chunk`` do not apply (HSTU has its own attention).
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        max_len: int,
        linear_dim: int | None = None,
        attention_dim: int | None = None,
        dropout: float = 0.0,
        num_buckets: int = 128,
        layer_norm_eps: float = 1e-6,
        *,
        config: FilterConfig | None = None,
    ) -> None:
        super().__init__()
        check_sizes(d_model=d_model, max_len=max_len, num_buckets=num_buckets)
        check_int("nhead", nhead)
        check_int("linear_dim", linear_dim, optional=True)
        check_int("attention_dim", attention_dim, optional=True)
        if linear_dim is None or attention_dim is None:
            check_heads(d_model, nhead)
        check_dropout("dropout", dropout)
        check_number("layer_norm_eps", layer_norm_eps, 0.0, low_open=True)
        config = FilterConfig() if config is None else config
        if config.gain != "group":
            raise ValueError("HSTU takes gain='group' only (gain='head': SASRec, BERT4Rec)")
        if not config.key_precision:
            raise ValueError("HSTU takes key_precision=True only (the ablation: SASRec, BERT4Rec)")
        if config.attention_gate is not None:
            raise ValueError("HSTU takes no attention_gate: its U projection is the gate")
        self.d_model, self.nhead, self.max_len = d_model, nhead, max_len
        self.init_filter(config, nhead, check_groups(d_model, nhead, config.groups))
        self.dv = linear_dim or d_model // nhead
        self.dqk = attention_dim or d_model // nhead
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, elementwise_affine=False)
        self.uvqk = nn.Linear(d_model, nhead * (2 * self.dv + 2 * self.dqk), bias=False)
        nn.init.normal_(self.uvqk.weight, 0.0, 0.02)
        self.rab = RelativeAttentionBias(max_len, num_buckets)
        self.norm_attn = nn.LayerNorm(nhead * self.dv, eps=layer_norm_eps, elementwise_affine=False)
        self.out_proj = nn.Linear(nhead * self.dv, d_model)
        nn.init.xavier_uniform_(self.out_proj.weight)
        self.dropout = nn.Dropout(dropout)

    def extra_repr(self) -> str:
        return f"precision={self.precision}, groups={self.groups}, N={self.max_len}"

    @property
    def value_weight(self) -> Tensor:
        """The V rows of f1: (H d_v, d)."""
        hv = self.nhead * self.dv
        return self.uvqk.weight[hv : 2 * hv]

    def forward(
        self,
        h: Tensor,
        log_prec: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = True,
        timestamps: Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """h: (B, T, d); log_prec: (B, T, G), -inf at padding, or None; timestamps: (B, T) or None.

        key_padding_mask: (B, T) bool, True = padding. Returns ``(h', log lambda'')``;
        in off mode the precision is passed through. ``last_only``: the last
        position only, (B, 1, ...), the same values (its query, U, update; the
        keys and values of every position), for evaluation.
        """
        valid = valid_positions(h, log_prec, key_padding_mask)
        allowed = build_allowed(valid, is_causal)  # (B, 1, T, T)
        default = lambda x: default_log_precision(x, self.groups, self.norm1.eps)  # noqa: E731
        if last_only and (self.training or self.calibrate_sill):  # the sill reads every position
            out, lp = self.forward(h, log_prec, key_padding_mask, is_causal, timestamps)
            return out[:, -1:], None if lp is None else lp[:, -1:]
        if last_only:
            allowed = allowed[:, :, -1:]
        if self.precision == "off":
            lp_out = log_prec[:, -1:] if last_only and log_prec is not None else log_prec
            return self._forward_off(h, valid, allowed, timestamps, last_only), lp_out
        if not last_only:
            return self.filter_step(
                h, log_prec, valid,
                observe=lambda lp: self._observe(h, lp, allowed, timestamps),
                dynamics=lambda h: (None, None),  # no FFN: Jbar = 0
                default=default,
            )  # fmt: skip
        lp_all = BF.clamp_log_prec(default(h) if log_prec is None else log_prec, valid)
        return self.filter_step(
            h[:, -1:], lp_all[:, -1:], valid[:, -1:],
            observe=lambda _: self._observe(h, lp_all, allowed, timestamps, True),
            dynamics=lambda h: (None, None), default=default,
        )  # fmt: skip

    def _project(
        self, h: Tensor, timestamps: Tensor | None, last_only: bool = False
    ) -> tuple[Tensor, ...]:
        """Pre-activation of V (B, T, H dv), U (B, Tq, H dv), V (B, H, T, dv), Q
        (B, H, Tq, dqk), K (B, H, T, dqk) and ``rab`` (B | 1, 1, Tq, T); Tq = T, or 1
        with ``last_only`` (U and Q of the last position)."""
        b, t, _ = h.shape
        x = self.norm1(h)
        hv, hq = self.nhead * self.dv, self.nhead * self.dqk
        w = self.uvqk.weight
        if last_only:  # V, K of every position (one product), U, Q of the last
            pre_vk = F.linear(x, torch.cat([w[hv : 2 * hv], w[2 * hv + hq :]]))
            pre_v, pre_k = pre_vk.split([hv, hq], dim=-1)
            pre_uq = F.linear(x[:, -1:], torch.cat([w[:hv], w[2 * hv : 2 * hv + hq]]))
            u, q = F.silu(pre_uq).split([hv, hq], dim=-1)
            v, k = F.silu(pre_v), F.silu(pre_k)
        else:
            pre = self.uvqk(x)
            u, v, q, k = F.silu(pre).split([hv, hv, hq, hq], dim=-1)
            pre_v = pre[..., hv : 2 * hv]
        tq = q.shape[1]
        v, k = (y.reshape(b, t, self.nhead, -1).transpose(1, 2) for y in (v, k))
        q = q.reshape(b, tq, self.nhead, -1).transpose(1, 2)
        return pre_v, u, v, q, k, self.rab(t, timestamps, last_only).unsqueeze(1)

    def _weights(self, q: Tensor, k: Tensor, rab: Tensor, allowed: Tensor) -> Tensor:
        """``w = SiLU(q.k + rab) / N`` on allowed entries, 0 elsewhere: (B, H, T, T).

        The mask multiplies as floats (:func:`BF.mask_weights`; a ``where`` with
        the bool mask is slower on a CPU): the same values for finite scores."""
        w = F.silu(q @ k.transpose(-1, -2) + rab.to(q.dtype)) / self.max_len
        return w * BF.mask_weights(allowed, w.dtype)

    def _forward_off(
        self, h: Tensor, valid: Tensor, allowed: Tensor, timestamps: Tensor | None,
        last_only: bool = False,
    ) -> Tensor:  # fmt: skip
        _, u, v, q, k, rab = self._project(h, timestamps, last_only)
        if last_only:
            h, valid = h[:, -1:], valid[:, -1:]
        b, t, _ = h.shape
        w = self._weights(q, k, rab, allowed)  # (B, H, Tq, T)
        a = (w @ v).transpose(1, 2).reshape(b, t, -1)  # (B, Tq, H dv)
        h = h + self.out_proj(self.dropout(self.norm_attn(a) * u))
        if self.record:
            w32 = w.detach().float()
            sum_p_sq = w32.square().sum(-1) / w32.abs().sum(-1).square().clamp_min(TINY)
            n_eff = BF.kish_n_eff(sum_p_sq).transpose(1, 2)  # (B, T, H)
            self.last_stats = FilterStats.plain(
                valid, self.groups, w if self.record_attention else None, n_eff=n_eff
            )
        return h

    def _observe(
        self, h: Tensor, lp: Tensor, allowed: Tensor, timestamps: Tensor | None,
        last_only: bool = False,
    ) -> Observation:  # fmt: skip
        """Pointwise attention weighted by the relative reliability, and the sandwich
        variance of its estimate through LN(A), the U gate and f2 (``docs/spec.md``,
        Blocks: HSTU). ``h``, ``lp``: every position (the keys); ``last_only``: the
        last position's query only."""
        b, t, d = h.shape
        hv = self.nhead * self.dv
        pre_v, u, v, q, k, rab = self._project(h, timestamps, last_only)
        tq = q.shape[2]
        has_key = BF.mask_weights(allowed, torch.float32).sum(dim=-1).squeeze(1) > 0  # (B, Tq)
        with torch.autocast(h.device.type, enabled=False):  # the filter runs in float32
            # observe: prior variance of V through LN, f1 (per channel) and SiLU
            sigma1 = BF.norm_sigma(h, self.norm1.eps, backward=self.backward)  # (B, T)
            s2_h = torch.exp(-lp) / sigma1.square().unsqueeze(-1)  # (B, T, G)
            p_v = BF.delta_rule_matrix(self.value_weight, hv, self.groups)  # (H dv, G)
            dsilu = J.silu_derivative(pre_v)  # (B, T, H dv)
            s2_v = (BF.delta_rule(s2_h, p_v) * dsilu.square()).view(b, t, self.nhead, -1).mean(-1)
            log_lbar = -torch.log(s2_v.clamp_min(TINY)).transpose(1, 2)  # (B, H, T)
            v32 = BF.upcast(v)  # (B, H, T, dv)
            w = self._weights(BF.upcast(q), BF.upcast(k), BF.upcast(rab), allowed)
            w = w * relative_reliability(log_lbar, allowed)  # (B, H, T, T)
            e = w @ v32  # (B, H, T, dv)
            # sandwich variance of e: one pass with weights w^2 over [1, v, ||v||^2 / dv]
            ones = torch.ones_like(v32[..., :1])
            m = w.square() @ torch.cat([ones, v32, v32.square().mean(-1, keepdim=True)], -1)
            s0, s1, s2 = m[..., 0], m[..., 1:-1], m[..., -1]  # (B, H, T), (B, H, T, dv), (B, H, T)
            sandwich = sandwich_variance(s0, s1, s2, s1 / s0.clamp_min(TINY).unsqueeze(-1))
            n_eff = BF.kish_n_eff(s0 / w.abs().sum(-1).square().clamp_min(TINY))  # (B, H, T)
            spread = sandwich / s0.clamp_min(TINY)
            var_e = BF.reml_variance(spread, n_eff, self.sill, self.nu0) * s0  # (B, H, T)
            # through LN(A), the U gate and f2 by the delta rule
            a = e.transpose(1, 2).reshape(b, tq, hv)  # (B, Tq, H dv)
            s2_n = (
                var_e.transpose(1, 2)
                / BF.norm_sigma(a, self.norm_attn.eps, backward=self.backward).square()[..., None]
            )
            s2_o = s2_n.repeat_interleave(self.dv, dim=-1) * BF.upcast(u).square()  # (B, T, H dv)
            p_o = BF.delta_rule_matrix(self.out_proj.weight, self.groups, hv)  # (G, H dv)
            s2_y = BF.delta_rule(s2_o, p_o)  # (B, T, G)
            lp_obs = (-torch.log(s2_y.clamp_min(TINY))).clamp(BF.LOG_PREC_MIN, BF.LOG_PREC_MAX)
        # the estimate came out of the float32 precision path: back to the stream's dtype
        y = self.out_proj(self.dropout(self.norm_attn(a.to(h.dtype)) * u))  # (B, T, d)
        weights = w if self.record_attention else None
        return Observation(y, lp_obs, has_key, n_eff, v32, weights=weights)  # values: all T


class HSTUEncoder(nn.Module):
    """A stack of ``num_layers`` copies of an ``HSTULayer``; precision threads through it.

    Layer ``l`` starts from the ``lambda''`` of layer ``l - 1``; layer 0 from
    ``log_precision`` (e.g. the prior ``tau``), or, when None, precision
    uniform in LN units (``1 / Var(h_t)``).
    """

    def __init__(self, layer: HSTULayer, num_layers: int) -> None:
        super().__init__()
        check_int("num_layers", num_layers)
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
        self.num_layers = num_layers
        self.precision = layer.precision
        self.groups = layer.groups

    def forward(
        self,
        src: Tensor,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = True,
        log_precision: Tensor | None = None,
        timestamps: Tensor | None = None,
        return_precision: bool = False,
        last_only: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """src: (B, T, d); log_precision: (B, T, G) or (B, T, 1), -inf at padding.

        timestamps: (B, T) or None. Returns the output (B, T, d), and with
        ``return_precision`` the final ``log lambda`` (B, T, G) too (None in off mode).
        ``last_only``: the last layer computes the last position only (B, 1, ...).
        """
        h, lp = run_stack(
            list(self.layers), src, log_precision,
            lambda _, layer, h, lp, last: layer(
                h, lp, src_key_padding_mask, is_causal, timestamps, last_only=last
            ),
            last_only,
        )  # fmt: skip
        return (h, lp) if return_precision else h
