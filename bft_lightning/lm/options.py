"""``BFTOptions``: how the LM's decoder layers run as Bayesian filters: one
``nn.filter.FilterConfig`` plus what only the LM has (its prior and dropout);
stored in BFT exports (``bft_options.json``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bft_lightning.nn.checks import check_dropout, check_number, check_sizes
from bft_lightning.nn.filter import FILTER_FIELDS, FilterConfig

# the LM's filter when none is given: the plain Llama
LM_FILTER_DEFAULTS = FilterConfig(precision="off")


def _default_filter() -> FilterConfig:
    return LM_FILTER_DEFAULTS


@dataclass
class BFTOptions:
    """How the decoder layers run as Bayesian filters.

    Args:
        filter: the layers' filter options (``FilterConfig``: precision, gate,
            groups, ``Q0``, sill, kernel, backward); default ``precision="off"``,
            the plain Llama. YAML: ``bft: {filter: {precision: "on"}}``. Its
            ``predict_noise`` is set per layer by the model (False on the last).
        prior_width: width of the per-token prior ``tau``: 1 or ``G``.
        prior_scale: ``c``; None means ``1 / mean Var(h0)`` of the embedding.
        dropout: dropout on attention weights and residual branches.
    """

    filter: FilterConfig = field(default_factory=_default_filter)
    prior_width: int = 1
    prior_scale: float | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.filter, FilterConfig):
            raise ValueError(f"filter must be a FilterConfig, got {type(self.filter).__name__}")
        check_sizes(prior_width=self.prior_width)
        check_number("prior_scale", self.prior_scale, 0.0, low_open=True, optional=True)
        check_dropout("dropout", self.dropout)

    @property
    def precision(self) -> str:
        """``"on"`` (BFT) or ``"off"`` (the plain Llama): the filter's."""
        return self.filter.precision

    def filter_config(self, predict_noise: bool = True) -> FilterConfig:
        """The decoder layers' ``FilterConfig`` (``predict_noise``: False for the last layer)."""
        return self.filter.replace(predict_noise=predict_noise)

    def to_dict(self) -> dict[str, Any]:
        """What ``bft_options.json`` holds: ``{"filter": {...}, "prior_width": ..., ...}``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> BFTOptions:
        """Read :meth:`to_dict`'s form, or the flat form that exports, checkpoint
        hyperparameters and configs wrote before ``filter`` existed
        (``{"precision": "on", "groups": 2, ..., "prior_width": 1}``; its filter
        keys go through ``FilterConfig.from_flat``). An unknown key is an error
        naming it."""
        own = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - own - FILTER_FIELDS)
        if unknown:
            raise ValueError(f"unknown BFT options {unknown}")
        base = options.get("filter")  # a FilterConfig or the dict of its fields
        flat = {k: v for k, v in options.items() if k in FILTER_FIELDS}
        config = FilterConfig.from_flat(flat, base, defaults=LM_FILTER_DEFAULTS)
        rest = {k: v for k, v in options.items() if k in own and k != "filter"}
        return cls(filter=config, **rest)
