"""The filter step, written once (``docs/spec.md``: Observe, Update, Predict, The sill).

Every BFT block is a :class:`FilterLayer`: the encoder layer
(``nn.layers``), the Llama decoder layer (``nn.decoder``) and the HSTU layer
(``nn.hstu``). A block supplies only what differs between them:

- ``observe(lp)``: its attention and the statistics of it, as an
  :class:`Observation` (the branch ``z`` to add and its precision
  ``log lambda_obs``); softmax blocks build it with :meth:`FilterLayer.kriging_observation`;
- ``dynamics(h')``: its FFN's output and the FFN's pooled Jacobian ``Jbar``
  (or no FFN at all, HSTU).

:meth:`FilterLayer.filter_step` runs the rest, the same for all three::

    lp   = clamp(log lambda or the default precision)         (B, T, G) float32
    obs  = observe(lp)                                        block
    K    = sigmoid(log lambda_obs - log lambda)               (B, T, G), 0 without a key
    h'   = h + K * z,   lambda' = lambda + lambda_obs
    f, Jbar = dynamics(h')                                    block
    lambda'' = ((1 + Jbar)^2 / lambda' + Q)^{-1},   h'' = h' + f
    stage the running sill; record

The precision path runs in float32 with autocast off in every block; the
attention kernel and the FFN run under the caller's autocast.

The sill policy (one, for every block; ``docs/spec.md``, The sill): a training
forward *stages* its running-sill update; it is applied by :meth:`flush_sill`,
which :func:`run_stack` (the one loop of ``BFTEncoder``, ``HSTUEncoder`` and
``LlamaModel``) calls at the start of each forward, and which runs before the
layer's state is saved or cast. A step therefore reads the sill of the previous step, and a layer
recomputed for gradient checkpointing reads the very sill its forward read and
stages nothing more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch
from torch import Tensor, nn

from bft_lightning.nn import functional as BF
from bft_lightning.nn import kernels
from bft_lightning.nn.checks import check_choice, check_int, check_number
from bft_lightning.nn.kernels import KrigingStats
from bft_lightning.nn.stats import FilterStats

__all__ = [
    "FilterConfig",
    "FilterLayer",
    "Observation",
    "run_stack",
    "check_groups",
    "default_log_precision",
    "valid_positions",
]


@dataclass(frozen=True)
class FilterConfig:
    """How a block runs as a Bayesian filter: one typed, validated set of options.

    Every field is checked at construction and a bad value names its field.
    jsonargparse reads it from YAML (``model.init_args.filter: {precision: on, ...}``).

    Args:
        precision: ``"on"`` (BFT) or ``"off"`` (exactly the plain layer).
        groups: precision groups ``G`` (a divisor of ``d``); None means one per head.
        q_init: initial process noise ``Q0 > 0``; ``Q = softplus(rho)``.
        nu0: degrees of freedom of the REML sill prior (>= 0).
        sill_momentum: momentum of the running sill, in [0, 1].
        predict_noise: False skips ``Q`` (a last layer whose precision feeds nothing).
        gain: ``"group"`` (a Kalman gain per residual group) or ``"head"`` (one per
            head before ``W_O``; encoder only, needs ``key_precision`` and no gate).
        key_precision: False attends without the keys' precision bias (an
            ablation; encoder only).
        attention_gate: None or ``"sigmoid"`` (the gated-attention baseline).
        attention_impl: the attention kernel, a name of ``nn.kernels.KERNELS``
            (``"chunked"``; ``"reference"``, a bare ``BFTEncoderLayer``'s;
            ``"sdpa"``; ``"blockwise"``), or ``"auto"`` (the default): the
            kernel dispatch runs ``"blockwise"`` while ``torch.compile`` traces
            (the kernel the compiler holds in one graph) and ``"chunked"``
            otherwise, the same values and gradients. HSTU has its own attention.
        attention_chunk: query block size of the chunked kernel.
        backward: ``"custom"`` (hand-written backward passes that keep only the
            FFN's own activations: eager training) or ``"autograd"`` (plain ops
            that autograd differentiates: for ``torch.compile``, whose inductor
            returned zero gradients through the hand-written ones on CUDA).
            Same values and gradients.
    """

    precision: Literal["off", "on"] = "on"
    groups: int | None = None
    q_init: float = 0.01
    nu0: float = 1.0
    sill_momentum: float = 0.01
    predict_noise: bool = True
    gain: Literal["group", "head"] = "group"
    key_precision: bool = True
    attention_gate: Literal["sigmoid"] | None = None
    attention_impl: str = kernels.AUTO
    attention_chunk: int = 256
    backward: Literal["custom", "autograd"] = "custom"

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, ("off", "on"))
        check_int("groups", self.groups, optional=True)
        check_number("q_init", self.q_init, 0.0, low_open=True)
        check_number("nu0", self.nu0, 0.0)
        check_number("sill_momentum", self.sill_momentum, 0.0, 1.0)
        for name in ("predict_noise", "key_precision"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_choice("gain", self.gain, ("group", "head"))
        check_choice("attention_gate", self.attention_gate, (None, "sigmoid"))
        check_choice("attention_impl", self.attention_impl, kernels.impl_names())
        check_int("attention_chunk", self.attention_chunk)
        check_choice("backward", self.backward, ("custom", "autograd"))
        if self.gain == "head" and self.attention_gate is not None:
            raise ValueError(
                "gain='head' takes no attention_gate: the gate rescales a head's output, "
                "which the per-head prior (the value's precision) does not see"
            )
        if self.gain == "head" and not self.key_precision:
            raise ValueError(
                "gain='head' needs key_precision=True: its prior is the value's precision, "
                "the same quantity the attention bias reads"
            )

    def replace(self, **changes: Any) -> FilterConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_flat(
        cls, flat: Mapping[str, Any], base: FilterConfig | None = None,
        defaults: FilterConfig | None = None,
    ) -> FilterConfig:  # fmt: skip
        """The one place where flat keyword options become a ``FilterConfig``.

        Flat options are ``torch.nn.TransformerEncoderLayer``'s style (a bare
        ``BFTEncoderLayer``), the recommenders' constructor keywords (so a
        command line such as ``--model.init_args.backbone.init_args.q_init=0.1``
        and the hyperparameters of checkpoints saved before ``filter:`` existed
        still build the model), and the LM's older ``bft_options.json``.

        flat: field name -> value; None means "not given" (every field whose
            value may be None has None as its default).
        base: the typed form given beside the flat one (the ``filter`` option,
            or the dict of its fields that a checkpoint records; None or equal
            to ``defaults`` means not given). Giving both is
            refused, naming the first flat option that differs from
            ``defaults``: two sources of one field would silently shadow each other.
        defaults: the values of fields the flat options leave out (the class's
            defaults when None).
        """
        unknown = sorted(set(flat) - FILTER_FIELDS)
        if unknown:
            options = ", ".join(sorted(FILTER_FIELDS))
            raise ValueError(f"{unknown[0]} is not a filter option (the options: {options})")
        start = cls() if defaults is None else defaults
        given = {k: v for k, v in flat.items() if v is not None}
        if isinstance(base, Mapping):
            base = cls(**base)
        if base is not None and not isinstance(base, FilterConfig):
            raise ValueError(f"filter must be a FilterConfig, got {type(base).__name__}")
        if base is None or base == start:
            return dataclasses.replace(start, **given)
        differ = [k for k, v in given.items() if v != getattr(start, k)]
        if differ:
            raise ValueError(
                f"{differ[0]}: give the filter options either in filter or flat, not both "
                f"(flat {', '.join(differ)} and filter={base})"
            )
        return base


FILTER_FIELDS = frozenset(f.name for f in dataclasses.fields(FilterConfig))


def check_groups(d_model: int, nhead: int, groups: int | None) -> int:
    """``G``: ``groups``, or ``nhead`` when None; a positive divisor of ``d_model``."""
    g = nhead if groups is None else groups
    if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or d_model % g:
        raise ValueError(f"groups={g} must be a positive divisor of d_model={d_model}")
    return g


def default_log_precision(h: Tensor, groups: int, eps: float, rms: bool = False) -> Tensor:
    """Precision uniform in Norm1 units: ``lambda_t = 1 / sigma1_t^2`` (B, T, G) float32.

    ``sigma1`` is the norm's own denominator (``sqrt(Var + eps)`` for LayerNorm,
    the rms for RMSNorm, with the norm's ``eps``). Used when a caller passes no
    precision. Per token, so it is causal and padding-invariant; by the delta
    rule it gives exactly softmax attention (``docs/spec.md``, Off mode and the
    default precision; with ``eps = 0`` instead, small-variance inputs drifted
    from softmax and a constant token got NaN gradients through ``sqrt(0)``).
    """
    log_sigma = BF.norm_sigma(h, eps, rms=rms).log()  # (B, T)
    return (-2.0 * log_sigma).unsqueeze(-1).expand(*h.shape[:2], groups)


def valid_positions(h: Tensor, log_prec: Tensor | None, padding: Tensor | None) -> Tensor:
    """(B, T) bool: not marked by ``padding`` (True = padding) and, with a precision,
    some group has ``log lambda > -inf`` (padding is precision 0)."""
    valid = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
    if padding is not None:
        valid = valid & ~padding.bool()
    if log_prec is not None:
        valid = valid & (log_prec > float("-inf")).any(dim=-1)
    return valid


@dataclass
class Observation:
    """What a block's attention gives the filter step (float32 unless noted).

    z: (B, T, d) the branch to add, in the stream's dtype, dropout applied;
        with ``project`` set, the heads' estimates side by side before ``W_O``
        (B, T, H d_h) instead.
    log_prec_obs: (B, T, G) ``log lambda_obs``, clamped.
    has_key: (B, T) bool, whether the query read any key (else ``K = 0``).
    n_eff: (B, H, T) effective sample size.
    values: (B, H, T, d_h) the values of the layer's own positions, for the sill.
    weights: (B, H, T, S) the attention weights to record, or None.
    gate: (B, T, H d_h) the attention gate to record, or None.
    head_gain: per-head gain ``gain="head"``: ``(log lambda_bar, log lambda_obs)``
        per head (B, T, H) each; None for the group gain.
    project: with ``head_gain``, ``W_O`` (and dropout) applied after the gain.
    """

    z: Tensor
    log_prec_obs: Tensor
    has_key: Tensor
    n_eff: Tensor
    values: Tensor
    weights: Tensor | None = None
    gate: Tensor | None = None
    head_gain: tuple[Tensor, Tensor] | None = None
    project: Callable[[Tensor], Tensor] | None = None


Observe = Callable[[Tensor], Observation]  # lp (B, T, G) -> Observation
Dynamics = Callable[[Tensor], tuple[Tensor | None, Tensor | None]]  # h' -> (f, Jbar)


def float32(x: Tensor) -> torch.autocast:
    """Autocast off on ``x``'s device: the precision path's context."""
    return torch.autocast(x.device.type, enabled=False)


class FilterLayer(nn.Module):
    """Base class of the BFT blocks: the filter's parameters, its state and its step.

    Holds ``rho`` (G,) (``Q = softplus(rho)``) and the running ``sill`` (H,)
    buffer under those names (so state dicts keep their keys), the options of
    the :class:`FilterConfig` as attributes (``precision``, ``groups``,
    ``nu0``, ``sill_momentum``, ``predict_noise``), and the recording
    protocol (``record``, ``record_attention``, ``last_stats``).
    """

    sill: Tensor
    rho: nn.Parameter | None

    def init_filter(self, config: FilterConfig, heads: int, groups: int, rho: bool = True) -> None:
        """Call from ``__init__`` after ``nn.Module.__init__``. ``rho=False``: a layer
        with no process noise parameter at all (the LM's last layer)."""
        self.config = config
        self.precision, self.groups, self.q_init = config.precision, groups, config.q_init
        self.nu0, self.sill_momentum = config.nu0, config.sill_momentum
        self.predict_noise, self.backward = config.predict_noise, config.backward
        self.rho = None
        if config.precision == "on":
            if rho:
                self.rho = nn.Parameter(
                    torch.full((groups,), BF.inverse_process_noise(config.q_init))
                )
            self.register_buffer("sill", torch.ones(heads))
        self.calibrate_sill = False  # calibration: replace the sill by this batch's
        self._pending_sill: Tensor | None = None
        self.record = False
        self.record_attention = False
        # a callback reads every position's statistics: evaluation runs the whole last layer
        self.record_all_positions = False
        self.last_stats: FilterStats | None = None

    # -- state ------------------------------------------------------------------------
    def process_noise(self) -> Tensor:
        """``Q`` (G,) float32: ``softplus(rho)``, or zeros without process noise."""
        if self.rho is None or not self.predict_noise:
            like = self.sill if self.precision == "on" else torch.zeros(())
            return torch.zeros(self.groups, dtype=like.dtype, device=like.device)
        return BF.process_noise(self.rho)

    @torch.no_grad()
    def reset_filter_state(self) -> None:
        """``rho`` back to ``Q0 = q_init`` and the sill back to 1."""
        if self.rho is not None:
            self.rho.fill_(BF.inverse_process_noise(self.q_init))
        if self.precision == "on":
            self.sill.fill_(1.0)
        self._pending_sill = None

    @torch.no_grad()
    def stage_sill(self, values: Tensor, valid: Tensor) -> None:
        """Stage this step's running-sill update (``functional.update_running_sill_``).

        A second call before :meth:`flush_sill` is a recompute of the same step
        (gradient checkpointing) and stages nothing: it would count the batch
        twice (and, under DDP, run one more all-reduce inside the backward).
        """
        if self._pending_sill is not None:
            return
        momentum = 1.0 if self.calibrate_sill else self.sill_momentum
        new = self.sill.clone()
        BF.update_running_sill_(new, values, valid, momentum)
        self._pending_sill = new

    @torch.no_grad()
    def flush_sill(self) -> None:
        """Apply a staged running-sill update to the ``sill`` buffer.

        The buffer is replaced by a new tensor, not written in place: a graph
        not yet differentiated may still read the old one.
        """
        if self._pending_sill is not None:
            self.sill = self._pending_sill
            self._pending_sill = None

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Self:
        self.flush_sill()  # a staged value would not follow the cast or the move
        super()._apply(fn, recurse)
        BF.keep_float32_(self)  # the running sill and rho stay float32
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self.flush_sill()  # checkpoints hold every update (exact resume)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
        self._pending_sill = None  # the loaded sill wins
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[arg-type]

    # -- the step ---------------------------------------------------------------------
    def kriging_observation(
        self, stats: KrigingStats, z: Tensor, out_weight: Tensor, heads: int,
        gate: Tensor | None = None, head_prior: Tensor | None = None,
    ) -> Observation:  # fmt: skip
        """The observation of softmax (kriging) attention (``docs/spec.md``, Observe, steps 4-8).

        ``sigma2 = REML(S, n_eff, s0^2)`` (times the head's mean squared gate with
        a gate), ``lambda_obs = n_eff / sigma2`` per head, to the residual groups
        through ``W_O`` (``out_weight``, (d, H d_h)) by the delta rule.
        ``head_prior`` (B, H, T) ``log lambda_bar`` asks for the per-head gain.
        stats: over the query heads; z: the branch (see :class:`Observation`).
        """
        with float32(z):
            has_key = (stats.sum_p_sq > 0).any(dim=1)  # (B, T)
            n_eff = BF.kish_n_eff(stats.sum_p_sq)  # (B, H, T)
            spread = BF.expanded_square_spread(stats.second_moment, stats.estimate)
            sigma2 = BF.reml_variance(spread, n_eff, self.sill, self.nu0)  # (B, H, T)
            if gate is not None:  # the gate scales each head's output: variance times gate^2
                b, t, _ = gate.shape
                g2 = BF.upcast(gate).square().view(b, t, heads, -1).mean(-1)  # (B, T, H)
                sigma2 = sigma2 * g2.transpose(1, 2)
            p_o = BF.delta_rule_matrix(out_weight, self.groups, heads)  # (G, H)
            lp_obs = BF.observation_log_precision(sigma2, n_eff, has_key, p_o)  # (B, T, G)
            head_gain = None
            if head_prior is not None:
                lp_head = BF.head_observation_log_precision(sigma2, n_eff, has_key)
                head_gain = (head_prior.transpose(1, 2), lp_head.transpose(1, 2))
        return Observation(z, lp_obs, has_key, n_eff, stats.values, head_gain=head_gain, gate=gate)

    def key_log_precision(
        self, lp: Tensor, sigma1: Tensor, value_weight: Tensor, heads: int, gamma1: Tensor | None
    ) -> Tensor:
        """``log lambda_bar`` (B, heads, T) of each key's value: the delta rule through
        Norm1 (``sigma1`` (B, T), ``gamma1``) and ``W_V`` (``docs/spec.md``, Observe, step 1)."""
        with float32(lp):
            p_v = BF.delta_rule_matrix(value_weight, heads, self.groups, gamma1)  # (heads, G)
            return BF.neighbour_log_precision(lp, sigma1, p_v)

    def filter_step(
        self, h: Tensor, log_prec: Tensor | None, valid: Tensor, observe: Observe,
        dynamics: Dynamics, default: Callable[[Tensor], Tensor],
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """One step of the filter. h: (B, T, d); log_prec: (B, T, G), -inf at padding,
        or None (then ``default(h)``); valid: (B, T). Returns ``(h'', log lambda'')``
        with -inf at invalid positions."""
        lp = BF.clamp_log_prec(default(h) if log_prec is None else log_prec, valid)  # (B, T, G)
        obs = observe(lp)
        with float32(h):  # update: the residual as a Kalman update
            if obs.head_gain is not None:
                gain = BF.kalman_gain(*obs.head_gain, obs.has_key)  # (B, T, H)
            else:
                gain = BF.kalman_gain(lp, obs.log_prec_obs, obs.has_key)  # (B, T, G)
            lp_post = BF.update_log_precision(lp, obs.log_prec_obs, obs.has_key)
        branch = BF.scale_groups(obs.z, gain)
        h = h + (branch if obs.project is None else obs.project(branch))
        f, jbar = dynamics(h)  # predict: the FFN's dynamics plus process noise
        with float32(h):
            jbar = torch.zeros_like(lp_post) if jbar is None else jbar  # (B, T, G)
            q = self.process_noise()
            lp_out = BF.predict_log_precision(lp_post, jbar, q)
        if f is not None:
            h = h + f
        if self.training or self.calibrate_sill:
            self.stage_sill(obs.values, valid)
        if self.record:
            self.last_stats = FilterStats.detached(
                valid=valid, log_prec=BF.with_padding(lp, valid),
                log_prec_obs=obs.log_prec_obs, gain=gain, n_eff=obs.n_eff.transpose(1, 2),
                log_prec_post=BF.with_padding(lp_post, valid), jbar=jbar,
                log_prec_out=BF.with_padding(lp_out, valid), q=q,
                attention=obs.weights, gate=obs.gate,
            )  # fmt: skip
        return h, BF.with_padding(lp_out, valid)


LayerStep = Callable[[int, Any, Tensor, Tensor | None, bool], tuple[Tensor, Tensor | None]]


def run_stack(
    layers: Sequence[nn.Module], h: Tensor, log_prec: Tensor | None, step: LayerStep,
    last_only: bool = False,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The loop of every stack of filter layers (``BFTEncoder``, ``HSTUEncoder``,
    ``LlamaModel``), so that none has to remember its parts.

    1. the previous step's running-sill update is applied in every layer first
       (``docs/spec.md``, The sill: a step reads the sill of the step before);
    2. the precision threads through: layer ``l`` starts from the
       ``log lambda''`` of layer ``l - 1``, layer 0 from ``log_prec`` (B, T, G),
       or (B, T, 1) broadcast to the groups, or None (the block's default);
    3. ``last_only`` reaches the last layer only (the earlier layers' keys and
       values are every position's).

    step: ``(index, layer, h, log_prec, last_only) -> (h, log_prec)``, the call
    of one layer with the stack's own arguments (masks, times, caches).
    Returns the last layer's output and precision, None in off mode.
    """
    for layer in layers:
        assert isinstance(layer, FilterLayer)
        layer.flush_sill()
    first = layers[0]
    assert isinstance(first, FilterLayer)
    if log_prec is not None and log_prec.shape[-1] == 1:
        log_prec = log_prec.expand(*log_prec.shape[:2], first.groups)
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        h, log_prec = step(i, layer, h, log_prec, last_only and i == last)
    return h, None if first.precision == "off" else log_prec
