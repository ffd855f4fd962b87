"""The recording interface every BFT layer exposes to callbacks and analysis.

A layer with ``record = True`` keeps, after each forward, a detached
``FilterStats`` of that forward in ``last_stats``; with ``record = False``
(the default) it keeps nothing and costs nothing. ``record_attention``
additionally keeps the attention weights. A callback finds such layers in any
model with ``find_filter_layers(model)``, by the ``FilterRecorder`` protocol,
so it needs no knowledge of the model's classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@dataclass
class FilterStats:
    """Diagnostics of one BFT layer for its last forward (detached, float32).

    Precisions are natural logs; padding positions are excluded by ``valid``.

    valid: (B, T) bool, positions with positive prior precision
    log_prec: (B, T, G) log lambda, the prior precision entering the layer
    log_prec_obs: (B, T, G) log lambda_obs, observation precision per group
    gain: (B, T, G) Kalman gain K (per head, (B, T, H), with ``gain="head"``)
    n_eff: (B, T, H) Kish effective sample size of the attention row
    log_prec_post: (B, T, G) log lambda' after the update
    jbar: (B, T, G) pooled FFN Jacobian (zeros for layers without an FFN)
    log_prec_out: (B, T, G) log lambda'' after the predict step
    q: (G,) process noise Q
    attention: (B, H, T, T) weights before dropout, only with record_attention
    gate: (B, T, d) sigmoid gate of gated attention, when the layer has one
    """

    valid: Tensor
    log_prec: Tensor
    log_prec_obs: Tensor
    gain: Tensor
    n_eff: Tensor
    log_prec_post: Tensor
    jbar: Tensor
    log_prec_out: Tensor
    q: Tensor
    attention: Tensor | None = None
    gate: Tensor | None = None

    @classmethod
    def detached(cls, **values: Tensor | None) -> FilterStats:
        """Build from live tensors: detach, and cast floating tensors to float32."""
        out = {}
        for f in fields(cls):
            v = values.get(f.name)
            if v is not None:
                v = v.detach()
                v = v.float() if v.is_floating_point() else v
            out[f.name] = v
        return cls(**out)  # type: ignore[arg-type]

    @classmethod
    def plain(
        cls,
        valid: Tensor,
        groups: int,
        attention: Tensor | None = None,
        gate: Tensor | None = None,
        nhead: int | None = None,
        n_eff: Tensor | None = None,
    ) -> FilterStats:
        """Stats of a ``precision="off"`` layer: gain 1, precision 0 (log), no Q.

        ``n_eff`` (B, T, H), when not given, comes from the softmax attention
        weights when they were recorded (zeros of width ``nhead`` otherwise).
        """
        b, t = valid.shape
        ones = torch.ones(b, t, groups, device=valid.device)
        zeros = torch.zeros_like(ones)
        if n_eff is None and attention is not None:
            sum_p_sq = attention.float().square().sum(-1)
            n_eff = torch.where(sum_p_sq > 0, 1.0 / sum_p_sq.clamp_min(1e-30), 0.0).transpose(1, 2)
        elif n_eff is None:
            n_eff = torch.zeros(b, t, nhead or 1, device=valid.device)
        return cls.detached(
            valid=valid, log_prec=zeros, log_prec_obs=zeros, gain=ones, n_eff=n_eff,
            log_prec_post=zeros, jbar=zeros, log_prec_out=zeros,
            q=torch.zeros(groups, device=valid.device), attention=attention, gate=gate,
        )  # fmt: skip

    def masked(self, name: str) -> Tensor:
        """A per-position quantity at valid positions only, flattened to (N, last_dim)."""
        value = getattr(self, name)
        if name == "q" or value is None:
            raise ValueError(f"{name!r} is not a per-position quantity")
        return value[self.valid]


@runtime_checkable
class FilterRecorder(Protocol):
    """What a callback needs of a BFT layer."""

    record: bool
    record_attention: bool
    last_stats: FilterStats | None


def find_filter_layers(model: nn.Module) -> Iterator[tuple[str, FilterRecorder]]:
    """Every module of ``model`` that follows the recording protocol, by name."""
    for name, module in model.named_modules():
        if isinstance(module, FilterRecorder) and isinstance(module, nn.Module):
            yield name, module


def set_recording(model: nn.Module, on: bool, attention: bool = False) -> None:
    """Switch recording on or off in every filter layer of ``model``."""
    for _, layer in find_filter_layers(model):
        layer.record = on
        layer.record_attention = on and attention
        if not on:
            layer.last_stats = None


def last_position_gain(model: nn.Module) -> Tensor | None:
    """(N,) float32 Kalman gain at the predicting (last) position, averaged over groups
    and layers.

    Reads the statistics the filter layers recorded in the forward that made the
    states (``set_recording(model, True)`` before it); None when none were
    recorded. A ``precision="off"`` layer records a gain of 1.
    """
    gains = [
        layer.last_stats.gain[:, -1].float().mean(-1)
        for _, layer in find_filter_layers(model)
        if layer.last_stats is not None
    ]
    return torch.stack(gains).mean(0) if gains else None


@contextmanager
def paused_recording(model: nn.Module) -> Iterator[None]:
    """Run a block with recording off in every filter layer, then restore each layer's
    flags; the statistics recorded before stay in ``last_stats``.

    For work that must not overwrite what callbacks read at batch end, such as
    generation after an evaluation forward: each cached decoding step would
    replace the forward's statistics by those of one token.
    """
    layers = [layer for _, layer in find_filter_layers(model)]
    flags = [(layer.record, layer.record_attention) for layer in layers]
    for layer in layers:
        layer.record = layer.record_attention = False
    try:
        yield
    finally:
        for layer, (record, attention) in zip(layers, flags, strict=True):
            layer.record, layer.record_attention = record, attention
