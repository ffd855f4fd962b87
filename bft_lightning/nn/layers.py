"""BFT encoder layer and stack (pre-norm, softmax attention, GELU/ReLU FFN).

One layer is one step of a Bayesian filter (``docs/spec.md``, Observe, Update, Predict):

1. observe:  ``x = Norm1(h)``; kriging attention with the keys' precision as
   a logit bias gives ``z = W_O e`` and its precision ``lambda_obs``;
2. update:   ``h' = h + K z`` with ``K = lambda_obs / (lambda + lambda_obs)``,
   ``lambda' = lambda + lambda_obs``;
3. predict:  ``h'' = h' + FFN(Norm2(h'))``,
   ``lambda'' = ((1 + Jbar)^2 / lambda' + Q)^{-1}``.

``precision="off"`` is exactly ``torch.nn.TransformerEncoderLayer(norm_first=True,
batch_first=True)``: same parameter names, so weights copy by ``load_state_dict``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bft_lightning.nn import functional as BF
from bft_lightning.nn.attention import KrigingAttention, KrigingStats, build_allowed
from bft_lightning.nn.checks import check_filter_options, check_heads, check_int, check_sizes
from bft_lightning.nn.stats import FilterStats

PRECISION_MODES = ("off", "on")
GAIN_MODES = ("group", "head")


def _activation_name(activation: str | Callable[[Tensor], Tensor] | nn.Module) -> str:
    if isinstance(activation, str):
        name = activation
    elif activation in (F.relu, torch.relu) or isinstance(activation, nn.ReLU):
        name = "relu"
    elif activation is F.gelu or (
        isinstance(activation, nn.GELU) and activation.approximate == "none"
    ):
        name = "gelu"
    else:
        raise ValueError(f"activation must be 'relu' or 'gelu' (exact), got {activation!r}")
    if name not in ("relu", "gelu"):
        raise ValueError(f"activation must be 'relu' or 'gelu', got {name!r}")
    return name


def _check_groups(d_model: int, nhead: int, groups: int | None) -> int:
    g = nhead if groups is None else groups
    if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or d_model % g:
        raise ValueError(f"groups={g} must be a positive divisor of d_model={d_model}")
    return g


def default_log_precision(h: Tensor, groups: int, eps: float) -> Tensor:
    """Precision uniform in Norm1 units: ``lambda_t = 1 / (Var(h_t) + eps)`` (B, T, G).

    Used when a caller passes no precision. Per token, so it is causal and
    padding-invariant; by the delta rule it gives plain softmax attention,
    exactly when ``eps`` is Norm1's own (the norm divides by
    ``sqrt(Var + eps)``: with ``eps = 0`` instead, small-variance inputs drifted
    from softmax, ~2e-2 at embedding scale, and a constant token, e.g. a zeroed
    padding row, got NaN gradients through ``sqrt(0)``).
    """
    return (-2.0 * BF.norm_sigma(h, eps).log()).unsqueeze(-1).expand(*h.shape[:2], groups)


class BFTEncoderLayer(nn.Module):
    """A pre-norm transformer encoder layer run as a Bayesian filter.

    Args:
        d_model: model width ``d``.
        nhead: attention heads ``H``.
        dim_feedforward: FFN width ``F``.
        dropout: dropout on attention weights, attention output and FFN.
        activation: ``"gelu"`` or ``"relu"`` (or ``F.gelu`` / ``F.relu``).
        layer_norm_eps: LayerNorm epsilon.
        batch_first: must be True (inputs are (B, T, d)).
        norm_first: must be True (pre-norm; the filter reading needs it).
        precision: ``"on"`` (BFT) or ``"off"`` (the plain layer).
        groups: precision groups ``G`` (a divisor of ``d``); None means ``H``.
        q_init: initial process noise ``Q0``; ``Q = softplus(rho)``.
        nu0: prior degrees of freedom of the REML sill prior.
        sill_momentum: momentum of the running sill ``s0^2``.
        attention_gate: None or ``"sigmoid"`` (gated-attention baseline).
        attention_impl: ``"reference"`` (materialised weights), ``"chunked"``
            (query blocks, memory-bounded, same values and gradients; the off
            twin then uses the fused kernel) or ``"sdpa"`` (fused, off mode only).
        attention_chunk: query block size of the ``"chunked"`` path.
        predict_noise: False skips ``Q`` (e.g. a last layer whose precision
            feeds nothing); True adds it.
        gain: ``"group"`` (``docs/spec.md``: a Kalman gain per residual group, on
            ``z = W_O e``) or ``"head"`` (one gain per head on its estimate
            before ``W_O``: ``z = W_O [K_a e_a]_a`` with
            ``K_a = lambda_obs_a / (lambda_bar_a + lambda_obs_a)``, where
            ``lambda_obs_a = n_eff / sigma2_a`` is head ``a``'s observation
            precision and ``lambda_bar_a`` the query's own value precision in
            that head, the key bias of the attention, both in the values'
            units, so no delta rule through ``W_O`` is needed; ``W_O``'s bias
            is not scaled). The posterior precision is the same in both modes.
            Recorded gains are (B, T, G) or, per head, (B, T, H).
        key_precision: True (``docs/spec.md``) puts the keys' precision into the
            attention as the logit bias ``log lambda_bar_j`` (kriging); False
            is an ablation that attends as the off twin does and keeps the
            Kalman update and the dynamics: the observation statistics, the
            gain and the precision path are those of the unbiased weights.
            It separates what precision-weighted attention does from what
            the adaptive gain does. Needs ``gain="group"``.
    """

    sill: Tensor
    rho: nn.Parameter

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = True,
        norm_first: bool = True,
        precision: str = "on",
        groups: int | None = None,
        q_init: float = 0.01,
        nu0: float = 1.0,
        sill_momentum: float = 0.01,
        attention_gate: str | None = None,
        attention_impl: str = "reference",
        predict_noise: bool = True,
        attention_chunk: int = 256,
        gain: str = "group",
        key_precision: bool = True,
    ) -> None:
        super().__init__()
        if not batch_first:
            raise ValueError("BFTEncoderLayer supports batch_first=True only (inputs (B, T, d))")
        if not norm_first:
            raise ValueError("BFTEncoderLayer supports norm_first=True only (pre-norm)")
        check_sizes(
            d_model=d_model, dim_feedforward=dim_feedforward, attention_chunk=attention_chunk
        )
        check_heads(d_model, nhead)
        check_filter_options(dropout, q_init, nu0, sill_momentum, layer_norm_eps)
        if precision not in PRECISION_MODES:
            raise ValueError(f"precision must be one of {PRECISION_MODES}, got {precision!r}")
        if gain not in GAIN_MODES:
            raise ValueError(f"gain must be one of {GAIN_MODES}, got {gain!r}")
        if gain == "head" and attention_gate is not None:
            raise ValueError(
                "gain='head' takes no attention_gate: the gate rescales a head's output, "
                "which the per-head prior (the value's precision) does not see"
            )
        if gain == "head" and not key_precision:
            raise ValueError(
                "gain='head' needs key_precision=True: its prior is the value's precision, "
                "the same quantity the attention bias reads"
            )
        self.d_model, self.nhead, self.precision, self.gain = d_model, nhead, precision, gain
        self.key_precision = key_precision
        self.groups = _check_groups(d_model, nhead, groups)
        self.activation = _activation_name(activation)
        self.nu0, self.sill_momentum, self.predict_noise = nu0, sill_momentum, predict_noise
        self.self_attn = KrigingAttention(
            d_model, nhead, dropout, attention_gate, attention_impl, attention_chunk
        )
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        if precision == "on":
            rho0 = BF.inverse_process_noise(q_init)
            self.rho = nn.Parameter(torch.full((self.groups,), rho0))
            self.register_buffer("sill", torch.ones(nhead))
        self.record = False
        self.record_attention = False
        self.last_stats: FilterStats | None = None

    def extra_repr(self) -> str:
        extra = f", gain={self.gain}" if self.gain != "group" else ""
        if self.precision == "on" and not self.key_precision:
            extra += ", key_precision=False"
        return (
            f"precision={self.precision}, groups={self.groups}, activation={self.activation}"
            + extra
        )

    def _ffn(self, u: Tensor, m: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The FFN's output and, given ``M`` (F, G), the Jacobian product ``phi'(a) @ M``
        (B, T, G) float32 from the same activation call (else None)."""
        a = self.linear1(u)  # (B, T, F)
        if m is None:
            act, jac = (F.gelu(a) if self.activation == "gelu" else F.relu(a)), None
        else:
            act, jac = BF.activation_with_jacobian(a, m, self.activation)
        return self.linear2(self.dropout(act)), jac

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Self:
        super()._apply(fn, recurse)
        BF.keep_float32_(self)  # the running sill and rho stay float32
        return self

    def forward(
        self,
        h: Tensor,
        log_prec: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """h: (B, T, d); log_prec: (B, T, G) with -inf at padding, or None.

        key_padding_mask: (B, T) bool, True = padding (as in ``torch.nn``).
        Returns ``(h'', log lambda'')``; in off mode the precision is passed through.
        """
        valid = self._valid(h, log_prec, key_padding_mask)
        if self.precision == "off":
            return self._forward_off(h, valid, is_causal, attn_mask), log_prec
        return self._forward_on(h, log_prec, valid, is_causal, attn_mask)

    @staticmethod
    def _valid(h: Tensor, log_prec: Tensor | None, key_padding_mask: Tensor | None) -> Tensor:
        valid = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        if key_padding_mask is not None:
            valid = valid & ~key_padding_mask.bool()
        if log_prec is not None:
            valid = valid & (log_prec > float("-inf")).any(dim=-1)
        return valid

    def _forward_off(
        self, h: Tensor, valid: Tensor, is_causal: bool, attn_mask: Tensor | None
    ) -> Tensor:
        allowed = build_allowed(valid, is_causal, attn_mask)
        z, weights, _, gate = self.self_attn(
            self.norm1(h), allowed, need_weights=self.record and self.record_attention
        )
        h = h + self.dropout1(z)
        f, _ = self._ffn(self.norm2(h))
        h = h + self.dropout2(f)
        if self.record:
            self.last_stats = FilterStats.plain(valid, self.groups, weights, gate, self.nhead)
        return h

    def _forward_on(
        self,
        h: Tensor,
        log_prec: Tensor | None,
        valid: Tensor,
        is_causal: bool,
        attn_mask: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        if log_prec is None:
            log_prec = default_log_precision(h, self.groups, self.norm1.eps)
        lp = BF.clamp_log_prec(log_prec, valid)  # (B, T, G) finite
        attn = self.self_attn
        # The precision path runs in float32 also under autocast: lambda spans
        # e^-20..e^20, beyond float16, and bf16's 8-bit mantissa blurs the gain.
        fp32 = torch.autocast(h.device.type, enabled=False)
        bias = None
        if self.key_precision:
            with fp32:  # observe: kriging with the keys' precision as a logit bias
                sigma1 = BF.norm_sigma(h, self.norm1.eps)  # float32 out
                p_v = BF.delta_rule_matrix(
                    attn.value_weight, self.nhead, self.groups, self.norm1.weight
                )
                bias = BF.neighbour_log_precision(lp, sigma1, p_v)  # (B, H, T)
        allowed = build_allowed(valid, is_causal, attn_mask)
        per_head = self.gain == "head"
        # per head: z holds the heads' estimates, not yet through W_O
        z, weights, stats, gate = attn(
            self.norm1(h), allowed, bias, with_stats=True, need_weights=self.record_attention,
            project=not per_head,
        )  # fmt: skip
        assert stats is not None
        with fp32:  # update: the residual as a Kalman update
            lp_obs, n_eff, has_key, lp_obs_head = self._observation(stats, gate, per_head)
            if lp_obs_head is not None:  # the query's own value precision against its head's
                assert bias is not None  # gain="head" requires key_precision
                gain = BF.kalman_gain(bias.transpose(1, 2), lp_obs_head, has_key)  # (B, T, H)
            else:
                gain = BF.kalman_gain(lp, lp_obs, has_key)  # (B, T, G)
            lp_post = BF.update_log_precision(lp, lp_obs, has_key)
        if per_head:
            h = h + self.dropout1(attn.out_proj(BF.scale_groups(z, gain)))
        else:
            h = h + BF.scale_groups(self.dropout1(z), gain)
        # predict: FFN dynamics plus process noise
        with fp32:
            m = BF.ffn_jacobian_matrix(
                self.linear1.weight, self.linear2.weight, self.norm2.weight, self.groups
            )
        f, jac = self._ffn(self.norm2(h), m)
        assert jac is not None
        with fp32:
            sigma_norm2 = BF.norm_sigma(h, self.norm2.eps).unsqueeze(-1)  # (B, T, 1) float32
            jbar = jac / sigma_norm2
            q = BF.process_noise(self.rho) if self.predict_noise else torch.zeros_like(self.rho)
            lp_out = BF.predict_log_precision(lp_post, jbar, q)
        h = h + self.dropout2(f)
        if self.training:
            self._update_sill(stats.values, valid)
        if self.record:
            self.last_stats = FilterStats.detached(
                valid=valid, log_prec=BF.with_padding(lp, valid),
                log_prec_obs=lp_obs, gain=gain, n_eff=n_eff.transpose(1, 2),
                log_prec_post=BF.with_padding(lp_post, valid), jbar=jbar,
                log_prec_out=BF.with_padding(lp_out, valid), q=q,
                attention=weights, gate=gate,
            )  # fmt: skip
        return h, BF.with_padding(lp_out, valid)

    def _observation(
        self, stats: KrigingStats, gate: Tensor | None, per_head: bool = False
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """REML observation precision per residual group, ``n_eff``, row validity and,
        with ``per_head``, the observation precision per head (B, T, H), else None."""
        has_key = (stats.sum_p_sq > 0).any(dim=1)  # (B, T)
        n_eff = BF.kish_n_eff(stats.sum_p_sq)  # (B, H, T)
        spread = BF.expanded_square_spread(stats.second_moment, stats.estimate)
        sigma2 = BF.reml_variance(spread, n_eff, self.sill, self.nu0)
        if gate is not None:  # the gate scales each head's output: variance times gate^2
            b, t, _ = gate.shape
            g2 = BF.upcast(gate).square().view(b, t, self.nhead, -1).mean(-1)  # (B, T, H)
            sigma2 = sigma2 * g2.transpose(1, 2)
        p_o = BF.delta_rule_matrix(self.self_attn.out_proj.weight, self.groups, self.nhead)
        lp_obs = BF.observation_log_precision(sigma2, n_eff, has_key, p_o)
        lp_obs_head = None
        if per_head:
            lp_obs_head = BF.head_observation_log_precision(sigma2, n_eff, has_key).transpose(1, 2)
        return lp_obs, n_eff, has_key, lp_obs_head

    @torch.no_grad()
    def _update_sill(self, values: Tensor, valid: Tensor) -> None:
        # a new tensor, not an in-place update: this step's graph may still read
        # the old value in its backward (under torch.compile it does)
        new = self.sill.clone()
        BF.update_running_sill_(new, values, valid, self.sill_momentum)
        self.sill = new


class BFTEncoder(nn.Module):
    """A stack of ``num_layers`` copies of a layer, mirroring ``nn.TransformerEncoder``.

    The precision state threads through the stack: layer ``l`` starts from the
    ``lambda''`` of layer ``l - 1``; layer 0 from ``log_precision`` (e.g. the
    layer-0 prior ``tau``), or, when None, precision uniform in Norm1 units.
    """

    def __init__(
        self, encoder_layer: BFTEncoderLayer, num_layers: int, norm: nn.Module | None = None
    ) -> None:
        super().__init__()
        check_int("num_layers", num_layers)
        self.layers = nn.ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.num_layers = num_layers
        self.norm = norm

    @property
    def precision(self) -> str:
        return self.first_layer.precision

    @property
    def first_layer(self) -> BFTEncoderLayer:
        layer = self.layers[0]
        assert isinstance(layer, BFTEncoderLayer)
        return layer

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
        log_precision: Tensor | None = None,
        return_precision: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """src: (B, T, d); log_precision: (B, T, G) or (B, T, 1), -inf at padding.

        ``mask`` is a (T, T) attention mask (bool True = blocked, or float 0 /
        -inf); ``is_causal=True`` blocks the future as well (with no mask, the
        causal mask; with one, both: a causal mask given as ``mask`` is unchanged,
        a narrower one, e.g. a causal window, is kept).
        Returns the output (B, T, d), and with ``return_precision`` the final
        ``log lambda`` (B, T, G) too (None in off mode).
        """
        causal = bool(is_causal)
        h, lp = src, log_precision
        if lp is not None and lp.shape[-1] == 1:
            lp = lp.expand(*lp.shape[:2], self.first_layer.groups)
        for layer in self.layers:
            h, lp = layer(h, lp, key_padding_mask=src_key_padding_mask, is_causal=causal,
                          attn_mask=mask)  # fmt: skip
        if self.norm is not None:
            h = self.norm(h)
        if self.precision == "off":
            lp = None
        return (h, lp) if return_precision else h

    @classmethod
    def from_torch(
        cls, encoder: nn.TransformerEncoder, precision: str = "on", **bft_options: object
    ) -> BFTEncoder:
        """Convert an ``nn.TransformerEncoder`` (pre-norm, batch-first), copying its weights.

        ``bft_options`` (``groups``, ``q_init``, ...) go to ``BFTEncoderLayer``.
        With ``precision="off"`` the result computes exactly what ``encoder`` does.
        """
        layers = list(encoder.layers)
        src = layers[0]
        if not isinstance(src, nn.TransformerEncoderLayer):
            raise TypeError(f"expected nn.TransformerEncoderLayer layers, got {type(src)}")
        layer = BFTEncoderLayer(
            d_model=src.self_attn.embed_dim,
            nhead=src.self_attn.num_heads,
            dim_feedforward=src.linear1.out_features,
            dropout=src.dropout.p,
            activation=src.activation,
            layer_norm_eps=src.norm1.eps,
            batch_first=src.self_attn.batch_first,
            norm_first=src.norm_first,
            precision=precision,
            **bft_options,  # type: ignore[arg-type]
        )
        norm = copy.deepcopy(encoder.norm) if encoder.norm is not None else None
        out = cls(layer, len(layers), norm)
        for mine, theirs in zip(out.layers, layers, strict=True):
            missing, unexpected = mine.load_state_dict(theirs.state_dict(), strict=False)
            extra = {k for k in missing if not k.startswith(("rho", "sill"))}
            if extra or unexpected:
                raise ValueError(f"weights do not match: missing {extra}, unexpected {unexpected}")
        return out.to(next(encoder.parameters()).device)
