"""BFT Llama decoder layer: RMSNorm, RoPE, SwiGLU, grouped-query attention, causal, KV cache.

One layer is one step of a Bayesian filter (``docs/spec.md``, Blocks: Decoder):

1. observe:  ``x = RMSNorm1(h)``; kriging attention in which each key carries
   ``log lambda_bar`` (its value's precision, by the delta rule through
   RMSNorm1 and W_V: ``W_V diag(gamma1)`` and the per-token ``1 / sigma1^2``,
   ``sigma1`` the rms) as a logit bias; REML gives ``lambda_obs``;
2. update:   ``h' = h + K z``, ``K = lambda_obs / (lambda + lambda_obs)``;
3. predict:  ``h'' = h' + SwiGLU(RMSNorm2(h'))`` and
   ``lambda'' = ((1 + Jbar)^2 / lambda' + Q)^{-1}`` with the SwiGLU Jacobian
   pooled with two matrices (``functional_llama.swiglu_pooled_jacobian``).

Grouped-query attention: values have ``Hkv`` heads, so the neighbour
precision is computed per KV head and broadcast to the ``H / Hkv`` query
heads that read it. The REML statistics are per query head.

``precision="off"`` is the plain Llama layer (``transformers``' ``LlamaDecoderLayer``):
the parameter names are the same, so a Llama checkpoint loads by name.

KV cache: per past key the layer keeps the rotated key, the value, the
key's validity and (precision on) its ``log lambda_bar`` bias. A key's bias
depends on that key's own state only, so cached decoding computes exactly
what a full forward computes (the sill is frozen in eval).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bft_lightning.nn import functional as BF
from bft_lightning.nn import functional_llama as FL
from bft_lightning.nn.attention import build_allowed
from bft_lightning.nn.checks import (
    check_choice,
    check_dropout,
    check_heads,
    check_number,
    check_sizes,
)
from bft_lightning.nn.filter import (
    FilterConfig,
    FilterLayer,
    Observation,
    check_groups,
    default_log_precision,
)
from bft_lightning.nn.kernels import KrigingStats, attend, impl_names
from bft_lightning.nn.stats import FilterStats

PRECISION_MODES = ("off", "on")


@dataclass
class LayerCache:
    """What one decoder layer keeps per past position for cached decoding.

    key: (B, Hkv, Tc, d_h) after RoPE; value: (B, Hkv, Tc, d_h);
    valid: (B, Tc) bool (positive precision / attention mask);
    bias: (B, Hkv, Tc) float32 ``log lambda_bar`` of each key (precision on), else None.
    """

    key: Tensor
    value: Tensor
    valid: Tensor
    bias: Tensor | None = None

    @property
    def length(self) -> int:
        return self.key.shape[2]


class RMSNorm(nn.Module):
    """``gamma * x / sigma`` with ``sigma = sqrt(mean x^2 + eps)`` (Llama's, float32 inside)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def sigma(self, x: Tensor) -> Tensor:
        """The norm's denominator per token (B, T), float32."""
        return BF.norm_sigma(x, self.eps, rms=True)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        y = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLU(nn.Module):
    """``W2 (silu(W1 u) * W3 u)``, W1 ``gate_proj``, W3 ``up_proj``, W2 ``down_proj``."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """u: (B, T, d) -> output (B, T, d), ``a = W1 u`` and ``b = W3 u`` (B, T, F)."""
        a, b = self.gate_proj(u), self.up_proj(u)
        return self.down_proj(F.silu(a) * b), a, b


class LlamaAttention(nn.Module):
    """Grouped-query causal attention with RoPE whose keys may carry a precision bias.

    With ``gate="sigmoid"`` each head's output is multiplied elementwise by
    ``sigmoid(x W_g + b_g)`` before ``o_proj`` (gated attention, Qiu et al. 2025).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        dropout: float = 0.0,
        gate: str | None = None,
        impl: str = "chunked",
        chunk_size: int = 256,
    ) -> None:
        super().__init__()
        check_sizes(d_model=d_model, n_heads=n_heads, head_dim=head_dim, attention_chunk=chunk_size)
        check_heads(n_heads, n_kv_heads, name="n_kv_heads", width="n_heads")
        check_dropout("dropout", dropout)
        if gate not in (None, "sigmoid"):
            raise ValueError(f"attention_gate must be None or 'sigmoid', got {gate!r}")
        check_choice("attention_impl", impl, impl_names())
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.dropout, self.impl, self.chunk_size = dropout, impl, chunk_size
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.attn_gate = nn.Linear(d_model, n_heads * head_dim) if gate == "sigmoid" else None

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        allowed: Tensor,
        bias: Tensor | None = None,
        past: LayerCache | None = None,
        with_stats: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, KrigingStats | None, Tensor | None, tuple[Tensor, Tensor]]:
        """x: (B, T, d) normed; rope: cos, sin (B, T, d_h); allowed: (B, 1, T, Tk);
        bias: (B, Hkv, Tk) per key (cached keys first) or None.

        Returns ``z = W_O e`` (B, T, d), the weights (B, H, T, Tk) or None, the
        kriging statistics or None, the gate (B, T, H d_h) or None, and all
        keys and values (B, Hkv, Tk, d_h) for the cache.
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, -1).transpose(1, 2)  # (B, H, T, dh)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, -1).transpose(1, 2)  # (B, Hkv, T, dh)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, -1).transpose(1, 2)
        q, k = FL.apply_rope(q, *rope), FL.apply_rope(k, *rope)
        if past is not None:
            k, v = torch.cat((past.key, k), dim=2), torch.cat((past.value, v), dim=2)
        rep = self.n_heads // self.n_kv_heads
        k_h, v_h = FL.repeat_kv(k, rep), FL.repeat_kv(v, rep)  # (B, H, Tk, dh)
        bias_h = FL.repeat_kv(bias, rep) if bias is not None else None  # (B, H, Tk)
        drop = self.dropout if self.training else 0.0
        out, weights, stats = attend(
            q, k_h, v_h, allowed, bias_h, drop, self.impl, self.chunk_size, with_stats, need_weights
        )
        out = out.to(v.dtype).transpose(1, 2).reshape(b, t, -1)  # (B, T, H dh)
        gate = None
        if self.attn_gate is not None:
            gate = torch.sigmoid(self.attn_gate(x))
            out = out * gate
        return self.o_proj(out), weights if need_weights else None, stats, gate, (k, v)


class BFTLlamaDecoderLayer(FilterLayer):
    """A Llama decoder layer (pre-RMSNorm, RoPE, GQA, SwiGLU, causal) run as a Bayesian filter.

    Args:
        d_model: hidden size ``d``.
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads ``Hkv`` (divides ``H``).
        d_ff: SwiGLU width ``F``.
        head_dim: per-head width; None means ``d / H``.
        rms_norm_eps: RMSNorm epsilon.
        attention_bias: biases on q/k/v/o projections (False for Llama).
        mlp_bias: biases on the SwiGLU projections (False for Llama).
        dropout: dropout on attention weights, on ``z`` and on the FFN output.
        config: how the layer runs as a filter (``FilterConfig``; default: BFT,
            ``precision="on"``). Its ``attention_impl``: ``"chunked"`` (the off
            layer runs PyTorch's fused attention, the BFT layer query blocks
            with a hand-written backward, no (T x Tk) weights kept),
            ``"sdpa"`` (fused where no statistics are needed, materialised
            weights otherwise), ``"reference"`` (always materialise the
            weights) or ``"auto"``; same values and gradients, and a call that
            records the weights takes the reference path. ``predict_noise=False``
            skips ``Q`` and has no ``rho`` (the last layer of an LM, whose
            ``lambda''`` feeds nothing). ``gain`` must be ``"group"`` and
            ``key_precision`` True.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        d_ff: int = 1024,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        dropout: float = 0.0,
        *,
        config: FilterConfig | None = None,
    ) -> None:
        super().__init__()
        check_sizes(d_model=d_model, n_heads=n_heads, d_ff=d_ff)
        if head_dim is None:
            check_heads(d_model, n_heads, name="n_heads")
        check_dropout("dropout", dropout)
        check_number("rms_norm_eps", rms_norm_eps, 0.0, low_open=True)
        config = FilterConfig() if config is None else config
        if config.gain != "group" or not config.key_precision:
            raise ValueError("BFTLlamaDecoderLayer takes gain='group' and key_precision=True only")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        head_dim = d_model // n_heads if head_dim is None else head_dim
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        groups_ = check_groups(d_model, n_heads, config.groups)
        self.init_filter(config, n_heads, groups_, rho=config.predict_noise)
        self.input_layernorm = RMSNorm(d_model, rms_norm_eps)
        self.self_attn = LlamaAttention(
            d_model, n_heads, n_kv_heads, head_dim, attention_bias, dropout,
            config.attention_gate, config.attention_impl, config.attention_chunk,
        )  # fmt: skip
        self.post_attention_layernorm = RMSNorm(d_model, rms_norm_eps)
        self.mlp = SwiGLU(d_model, d_ff, mlp_bias)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def extra_repr(self) -> str:
        return (
            f"precision={self.precision}, groups={self.groups}, "
            f"kv_heads={self.n_kv_heads}, predict_noise={self.predict_noise}"
        )

    def forward(
        self,
        h: Tensor,
        log_prec: Tensor | None,
        rope: tuple[Tensor, Tensor],
        valid: Tensor,
        past: LayerCache | None = None,
    ) -> tuple[Tensor, Tensor | None, LayerCache]:
        """h: (B, T, d) new positions; log_prec: (B, T, G), -inf at padding, or None.

        rope: cos, sin (B, T, d_h) of the new positions; valid: (B, T) bool of the
        new positions (attention mask); past: this layer's cache of earlier
        positions or None. Returns ``(h'', log lambda'', cache)``; the cache
        covers past and new positions. In off mode the precision passes through.
        """
        if log_prec is not None:
            valid = valid & (log_prec > float("-inf")).any(dim=-1)
        valid_keys = valid if past is None else torch.cat((past.valid, valid), dim=1)  # (B, Tk)
        if past is None:
            allowed = build_allowed(valid, is_causal=True)
        else:
            allowed = FL.causal_allowed(valid_keys, h.shape[1])  # (B, 1, T, Tk)
        if self.precision == "off":
            h, cache = self._forward_off(h, rope, valid, valid_keys, allowed, past)
            return h, log_prec, cache
        caches: list[LayerCache] = []
        norm1 = self.input_layernorm
        h, lp = self.filter_step(
            h, log_prec, valid,
            observe=lambda lp: self._observe(h, lp, rope, valid_keys, allowed, past, caches),
            dynamics=self._dynamics,
            default=lambda x: default_log_precision(x, self.groups, norm1.eps, rms=True),
        )  # fmt: skip
        return h, lp, caches[0]

    def _forward_off(
        self,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        valid: Tensor,
        valid_keys: Tensor,
        allowed: Tensor,
        past: LayerCache | None,
    ) -> tuple[Tensor, LayerCache]:
        z, weights, _, gate, (k, v) = self.self_attn(
            self.input_layernorm(h), rope, allowed, None, past,
            need_weights=self.record and self.record_attention,
        )  # fmt: skip
        h = h + self.dropout1(z)
        f, _, _ = self.mlp(self.post_attention_layernorm(h))
        h = h + self.dropout2(f)
        if self.record:
            self.last_stats = FilterStats.plain(valid, self.groups, weights, gate, self.n_heads)
        return h, LayerCache(k, v, valid_keys)

    def _observe(
        self,
        h: Tensor,
        lp: Tensor,
        rope: tuple[Tensor, Tensor],
        valid_keys: Tensor,
        allowed: Tensor,
        past: LayerCache | None,
        caches: list[LayerCache],
    ) -> Observation:
        """Kriging attention with each key's value precision (per KV head) as a logit bias."""
        norm1, attn = self.input_layernorm, self.self_attn
        with torch.autocast(h.device.type, enabled=False):
            sigma1 = norm1.sigma(h)  # (B, T)
        bias = self.key_log_precision(
            lp, sigma1, attn.v_proj.weight, self.n_kv_heads, norm1.weight
        )  # (B, Hkv, T) fmt: skip
        if past is not None and past.bias is not None:
            bias = torch.cat((past.bias, bias), dim=2)  # (B, Hkv, Tk)
        z, weights, stats, gate, (k, v) = attn(
            norm1(h), rope, allowed, bias, past, with_stats=True,
            need_weights=self.record and self.record_attention,
        )  # fmt: skip
        assert stats is not None
        caches.append(LayerCache(k, v, valid_keys, bias))
        # the sill reads the new positions' values only (not the cache)
        new = KrigingStats(stats.second_moment, stats.estimate, stats.sum_p_sq,
                           stats.values[:, :, -h.shape[1] :])  # fmt: skip
        obs = self.kriging_observation(
            new, self.dropout1(z), attn.o_proj.weight, self.n_heads, gate
        )
        obs.weights = weights
        return obs

    def _dynamics(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """SwiGLU's output (dropout applied) and its pooled Jacobian ``Jbar`` (B, T, G)."""
        norm2, mlp = self.post_attention_layernorm, self.mlp
        f, a, b = mlp(norm2(h))
        with torch.autocast(h.device.type, enabled=False):
            m1, m3 = FL.swiglu_jacobian_matrices(
                mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                norm2.weight, self.groups,
            )  # fmt: skip
            jbar = FL.swiglu_pooled_jacobian(a, b, m1, m3, norm2.sigma(h), self.backward)
        return self.dropout2(f), jbar
