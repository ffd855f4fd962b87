"""``BFTOptions``: how the LM's decoder layers run as Bayesian filters (the LM's side of
``nn.filter.FilterConfig``, plus its prior and dropout); stored in BFT exports."""

from __future__ import annotations

from dataclasses import dataclass

from bft_lightning.nn.checks import (
    check_choice,
    check_filter_options,
    check_int,
    check_number,
    check_sizes,
)
from bft_lightning.nn.filter import FilterConfig
from bft_lightning.nn.kernels import KERNELS


@dataclass
class BFTOptions:
    """How the decoder layers run as Bayesian filters.

    Args:
        precision: ``"off"`` (the plain Llama) or ``"on"`` (BFT).
        attention_gate: None or ``"sigmoid"`` (gated-attention baseline).
        groups: precision groups ``G``; None means the number of query heads.
        q_init: initial process noise ``Q0`` (from scratch; calibration overrides).
        nu0: REML prior degrees of freedom.
        sill_momentum: momentum of the running sill.
        prior_width: width of the per-token prior ``tau``: 1 or ``G``.
        prior_scale: ``c``; None means ``1 / mean Var(h0)`` of the embedding.
        dropout: dropout on attention weights and residual branches.
        attention_impl: ``"chunked"`` (default: PyTorch's fused attention in off
            mode, query blocks with no (T x T) weights kept in on mode),
            ``"sdpa"`` (fused in off mode, materialised weights in on mode) or
            ``"reference"`` (materialised weights in both).
        attention_chunk: query block size of the chunked path.
        backward: ``"custom"`` (hand-written backward passes) or ``"autograd"``
            (plain ops, for ``torch.compile``); see ``nn.filter.FilterConfig``.

    The layers' share of these options is :meth:`filter_config`.
    """

    precision: str = "off"
    attention_gate: str | None = None
    groups: int | None = None
    q_init: float = 0.01
    nu0: float = 1.0
    sill_momentum: float = 0.01
    prior_width: int = 1
    prior_scale: float | None = None
    dropout: float = 0.0
    attention_impl: str = "chunked"
    attention_chunk: int = 256
    backward: str = "custom"

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, ("off", "on"))
        check_choice("attention_gate", self.attention_gate, (None, "sigmoid"))
        check_choice("attention_impl", self.attention_impl, tuple(KERNELS))
        check_choice("backward", self.backward, ("custom", "autograd"))
        check_int("groups", self.groups, optional=True)
        check_sizes(prior_width=self.prior_width, attention_chunk=self.attention_chunk)
        check_number("prior_scale", self.prior_scale, 0.0, low_open=True, optional=True)
        check_filter_options(self.dropout, self.q_init, self.nu0, self.sill_momentum, 1.0)

    def filter_config(self, predict_noise: bool = True) -> FilterConfig:
        """The decoder layers' ``FilterConfig`` (``predict_noise``: False for the last layer)."""
        return FilterConfig(
            precision=self.precision, groups=self.groups, q_init=self.q_init, nu0=self.nu0,  # type: ignore[arg-type]
            sill_momentum=self.sill_momentum, predict_noise=predict_noise,
            attention_gate=self.attention_gate, attention_impl=self.attention_impl,  # type: ignore[arg-type]
            attention_chunk=self.attention_chunk, backward=self.backward,  # type: ignore[arg-type]
        )  # fmt: skip
