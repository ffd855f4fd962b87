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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bft_lightning.nn import functional as BF
from bft_lightning.nn import jacobian as J
from bft_lightning.nn.attention import KrigingAttention, build_allowed
from bft_lightning.nn.checks import check_filter_options, check_heads, check_int, check_sizes
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

PRECISION_MODES = ("off", "on")
GAIN_MODES = ("group", "head")
_check_groups = check_groups  # the old name


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


class BFTEncoderLayer(FilterLayer):
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
        backward: str = "custom",
        *,
        config: FilterConfig | None = None,
    ) -> None:
        super().__init__()
        if not batch_first:
            raise ValueError("BFTEncoderLayer supports batch_first=True only (inputs (B, T, d))")
        if not norm_first:
            raise ValueError("BFTEncoderLayer supports norm_first=True only (pre-norm)")
        check_sizes(d_model=d_model, dim_feedforward=dim_feedforward)
        check_heads(d_model, nhead)
        check_filter_options(dropout, q_init, nu0, sill_momentum, layer_norm_eps)
        if config is None:  # the flat options (torch.nn.TransformerEncoderLayer's style)
            check_groups(d_model, nhead, groups)  # names d_model in the error
            config = FilterConfig.from_flat(dict(
                precision=precision, groups=groups, q_init=q_init, nu0=nu0,
                sill_momentum=sill_momentum, predict_noise=predict_noise, gain=gain,
                key_precision=key_precision, attention_gate=attention_gate,
                attention_impl=attention_impl, attention_chunk=attention_chunk, backward=backward,
            ))  # fmt: skip
        self.d_model, self.nhead, self.gain = d_model, nhead, config.gain
        self.key_precision = config.key_precision
        self.activation = _activation_name(activation)
        self.init_filter(config, nhead, check_groups(d_model, nhead, config.groups))
        self.self_attn = KrigingAttention(
            d_model, nhead, dropout, config.attention_gate, config.attention_impl,
            config.attention_chunk,
        )  # fmt: skip
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

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
            act, jac = J.activation_with_jacobian(a, m, self.activation, self.backward)
        return self.linear2(self.dropout(act)), jac

    def forward(
        self,
        h: Tensor,
        log_prec: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        attn_mask: Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """h: (B, T, d); log_prec: (B, T, G) with -inf at padding, or None.

        key_padding_mask: (B, T) bool, True = padding (as in ``torch.nn``).
        Returns ``(h'', log lambda'')``; in off mode the precision is passed through.
        ``last_only``: the output of the last position only, (B, 1, d) and (B, 1, G)
        (evaluation: the attention query, the update and the FFN of that position;
        keys and values from all). The same values as the full output's last position.
        """
        valid = valid_positions(h, log_prec, key_padding_mask)  # (B, T)
        allowed = build_allowed(valid, is_causal, attn_mask)  # (B, 1, T, T)
        default = lambda x: default_log_precision(x, self.groups, self.norm1.eps)  # noqa: E731
        if last_only and (self.training or self.calibrate_sill):  # the sill reads every position
            out, lp = self.forward(h, log_prec, key_padding_mask, is_causal, attn_mask)
            return out[:, -1:], None if lp is None else lp[:, -1:]
        if last_only:
            allowed = allowed[:, :, -1:]
            if self.precision == "off":
                lp_last = None if log_prec is None else log_prec[:, -1:]
                return self._forward_off(h, valid, allowed, True), lp_last
            lp_all = BF.clamp_log_prec(default(h) if log_prec is None else log_prec, valid)
            return self.filter_step(
                h[:, -1:], lp_all[:, -1:], valid[:, -1:],
                observe=lambda _: self._observe(h, lp_all, allowed, True),
                dynamics=self._dynamics, default=default,
            )  # fmt: skip
        if self.precision == "off":
            return self._forward_off(h, valid, allowed), log_prec
        return self.filter_step(
            h, log_prec, valid,
            observe=lambda lp: self._observe(h, lp, allowed),
            dynamics=self._dynamics, default=default,
        )  # fmt: skip

    _valid = staticmethod(valid_positions)  # the old name

    def _forward_off(
        self, h: Tensor, valid: Tensor, allowed: Tensor, last_only: bool = False
    ) -> Tensor:
        z, weights, _, gate = self.self_attn(
            self.norm1(h), allowed, need_weights=self.record and self.record_attention,
            last_only=last_only,
        )  # fmt: skip
        if last_only:
            h, valid = h[:, -1:], valid[:, -1:]
        h = h + self.dropout1(z)
        f, _ = self._ffn(self.norm2(h))
        h = h + self.dropout2(f)
        if self.record:
            self.last_stats = FilterStats.plain(valid, self.groups, weights, gate, self.nhead)
        return h

    def _observe(
        self, h: Tensor, lp: Tensor, allowed: Tensor, last_only: bool = False
    ) -> Observation:
        """Kriging attention with the keys' precision as a logit bias (``docs/spec.md``,
        Observe); with ``key_precision=False`` the off twin's weights. ``last_only``:
        the last position's query (``h``, ``lp`` of every position, the keys)."""
        attn = self.self_attn
        bias = None
        if self.key_precision:
            with torch.autocast(h.device.type, enabled=False):
                sigma1 = BF.norm_sigma(h, self.norm1.eps, backward=self.backward)  # (B, T)
            bias = self.key_log_precision(
                lp, sigma1, attn.value_weight, self.nhead, self.norm1.weight
            )  # (B, H, T) fmt: skip
        per_head = self.gain == "head"
        # per head: z holds the heads' estimates, not yet through W_O
        z, weights, stats, gate = attn(
            self.norm1(h), allowed, bias, with_stats=True, need_weights=self.record_attention,
            project=not per_head, last_only=last_only,
        )  # fmt: skip
        assert stats is not None
        prior = None if bias is None or not per_head else bias[:, :, -z.shape[1] :]  # the queries'
        obs = self.kriging_observation(
            stats, z if per_head else self.dropout1(z), attn.out_proj.weight, self.nhead, gate,
            head_prior=prior,
        )  # fmt: skip
        if per_head:
            obs.project = lambda x: self.dropout1(attn.out_proj(x))
        obs.weights = weights
        return obs

    def _dynamics(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """The FFN's output (dropout applied) and its pooled Jacobian ``Jbar`` (B, T, G)."""
        with torch.autocast(h.device.type, enabled=False):
            m = J.ffn_jacobian_matrix(
                self.linear1.weight, self.linear2.weight, self.norm2.weight, self.groups
            )  # (F, G)
        f, jac = self._ffn(self.norm2(h), m)
        assert jac is not None
        with torch.autocast(h.device.type, enabled=False):
            sigma2 = BF.norm_sigma(h, self.norm2.eps, backward=self.backward)  # (B, T) float32
            jbar = jac / sigma2.unsqueeze(-1)
        return self.dropout2(f), jbar


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
        last_only: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """src: (B, T, d); log_precision: (B, T, G) or (B, T, 1), -inf at padding.

        ``mask`` is a (T, T) attention mask (bool True = blocked, or float 0 /
        -inf); ``is_causal=True`` blocks the future as well (with no mask, the
        causal mask; with one, both: a causal mask given as ``mask`` is unchanged,
        a narrower one, e.g. a causal window, is kept).
        Returns the output (B, T, d), and with ``return_precision`` the final
        ``log lambda`` (B, T, G) too (None in off mode). ``last_only``: the last
        layer computes the last position only (B, 1, ...), the same values
        (``BFTEncoderLayer.forward``): what evaluation reads.
        """
        causal = bool(is_causal)
        h, lp = run_stack(
            list(self.layers), src, log_precision,
            lambda _, layer, h, lp, last: layer(
                h, lp, key_padding_mask=src_key_padding_mask, is_causal=causal,
                attn_mask=mask, last_only=last,
            ),
            last_only,
        )  # fmt: skip
        if self.norm is not None:
            h = self.norm(h)
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
