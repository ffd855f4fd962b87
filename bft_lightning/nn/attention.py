"""Attention for BFT layers: softmax (kriging) attention and the gated baseline.

``KrigingAttention`` mirrors ``torch.nn.MultiheadAttention``'s parameter names
(``in_proj_weight``, ``in_proj_bias``, ``out_proj``) so that weights copy
across by ``load_state_dict``. The attention kernel is chosen by one switch
(``impl``): ``"reference"`` materialises the (T x T) weights and returns the
statistics the filter needs; ``"chunked"`` returns the same values and
gradients from query blocks with a hand-written backward, so no (T x T)
weights are kept (``nn.chunked``; long contexts); ``"sdpa"`` calls PyTorch's
fused kernel where no statistics are needed (``precision="off"``). With
``"chunked"`` or ``"sdpa"`` the off twin uses the fused kernel, and a call
that asks for the weights (``need_weights``, e.g. the attention-sink monitor)
takes the reference path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bft_lightning.nn.checks import check_dropout, check_heads, check_int
from bft_lightning.nn.chunked import chunked_attention, masked_value
from bft_lightning.nn.functional import upcast

ATTENTION_IMPLS = ("reference", "chunked", "sdpa")


@dataclass
class KrigingStats:
    """What the filter needs from one attention call (all float32, before dropout).

    second_moment: (B, H, T) ``sum_j p ||v_j||^2 / d_h``
    estimate: (B, H, T, d_h) ``e = sum_j p v_j``
    sum_p_sq: (B, H, T) ``sum_j p^2`` (0 for a row with no valid key)
    values: (B, H, T, d_h) the values, for the sill's running statistic
    """

    second_moment: Tensor
    estimate: Tensor
    sum_p_sq: Tensor
    values: Tensor


def build_allowed(valid: Tensor, is_causal: bool, attn_mask: Tensor | None = None) -> Tensor:
    """Boolean (B, 1, T, T) mask of the keys a query may read.

    valid: (B, T) keys with positive precision; attn_mask: (T, T) bool (True =
    blocked, as in ``torch.nn``) or float with entries 0 (allowed) and -inf
    (blocked). Other finite values (an additive score bias, which ``torch.nn``
    also accepts) are refused: the layers take a mask, not a bias, and adding
    it to the kriging logits would change the precision weighting's meaning.
    """
    t = valid.shape[1]
    allowed = valid[:, None, None, :]
    if is_causal:
        causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
        allowed = allowed & causal
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            blocked = attn_mask
        else:
            blocked = torch.isneginf(attn_mask)
            if bool(((attn_mask != 0) & ~blocked).any()):
                raise ValueError(
                    "attn_mask: a float mask may hold only 0 (allowed) and -inf (blocked); "
                    "finite score biases are not supported (pass a bool mask or 0/-inf)"
                )
        allowed = allowed & ~blocked
    return allowed.expand(valid.shape[0], 1, t, t)


def is_autocast(x: Tensor) -> bool:
    """Whether autocast is on for ``x``'s device type."""
    return torch.is_autocast_enabled(x.device.type)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    bias: Tensor | None,
    dropout_p: float,
    with_stats: bool,
    need_weights: bool = True,
) -> tuple[Tensor, Tensor, KrigingStats | None]:
    """Materialised kriging attention.

    ``p = softmax_j(q.k / sqrt(d_h) + bias_j)`` over allowed keys; rows with no
    allowed key give ``p = 0``. With statistics, the scores are computed in
    float32 (the spread is a difference of two large numbers), and one product
    with the values ``[v, ||v||^2 / d_h]`` gives both the estimate and the
    second moment. The bias is fused into the score product (``baddbmm``) and
    empty rows are zeroed on the (T x d_h) outputs, not on the (T x T) weights.

    q: (B, H, T, d_h); k, v: (B, H, S, d_h); allowed: (B, 1, T, S); bias:
    (B, H, S) per key. Returns the estimate with dropout (B, H, T, d_h), the
    weights before dropout (B, H, T, S; exact only with ``need_weights``) and the
    statistics (or None).
    """
    if with_stats:
        q, k, v = upcast(q), upcast(k), upcast(v)
    b, h, t, dh = q.shape
    s = k.shape[2]
    scale = 1.0 / math.sqrt(dh)
    qf, kf = q.reshape(b * h, t, dh), k.reshape(b * h, s, dh).transpose(1, 2)
    if bias is None:
        scores = torch.bmm(qf, kf) * scale
    else:
        scores = torch.baddbmm(bias.reshape(b * h, 1, s).to(q.dtype), qf, kf, alpha=scale)
    scores = scores.view(b, h, t, s).masked_fill(~allowed, masked_value(scores.dtype))
    p = torch.softmax(scores, dim=-1)
    has_key = allowed.any(dim=-1, keepdim=True).to(p.dtype)  # (B, 1, T, 1)
    p_drop = F.dropout(p, dropout_p) if dropout_p > 0 else p
    weights = p * has_key if need_weights else p
    if not with_stats:
        return (p_drop @ v) * has_key, weights, None
    v_aug = torch.cat([v, v.square().mean(dim=-1, keepdim=True)], dim=-1)
    e_aug = (p @ v_aug) * has_key  # (B, H, T, d_h + 1)
    estimate, second_moment = e_aug[..., :-1], e_aug[..., -1]
    out = (p_drop @ v) * has_key if dropout_p > 0 else estimate
    sum_p_sq = (p.unsqueeze(-2) @ p.unsqueeze(-1)).view(b, h, t) * has_key.view(b, 1, t)
    stats = KrigingStats(
        second_moment=second_moment, estimate=estimate, sum_p_sq=sum_p_sq, values=v
    )
    return out, weights, stats


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, dropout_p: float) -> Tensor:
    """Fused softmax attention; rows with no allowed key give 0 (no NaN)."""
    has_key = allowed.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
    safe = allowed | ~has_key
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, dropout_p=dropout_p)
    return out * has_key.to(out.dtype)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    bias: Tensor | None,
    dropout_p: float,
    impl: str,
    chunk_size: int,
    with_stats: bool = False,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None, KrigingStats | None]:
    """One attention call by ``impl`` (``ATTENTION_IMPLS``); the kernel switch of every layer.

    A call with no statistics and no bias takes PyTorch's fused kernel unless
    ``impl`` is ``"reference"``; ``"chunked"`` computes the statistics in query
    blocks; everything else, and any call that needs the weights, takes the
    materialised reference. The statistics are computed in float32
    (``docs/spec.md``, Observe), also under autocast. q: (B, H, T, d_h); k, v: (B, H, S, d_h);
    allowed: (B, 1, T, S); bias: (B, H, S) or None. Returns the output
    (B, H, T, d_h), the weights (B, H, T, S; exact only with ``need_weights``)
    or None, and the statistics or None.
    """
    fused = impl != "reference" and not need_weights
    if fused and not with_stats and bias is None:
        return sdpa_attention(q, k, v, allowed, dropout_p), None, None
    if with_stats:
        q, k, v = upcast(q), upcast(k), upcast(v)
        bias = None if bias is None else upcast(bias)
    with torch.autocast(q.device.type, enabled=not with_stats and is_autocast(q)):
        if fused and impl == "chunked":
            out, estimate, second_moment, sum_p_sq = chunked_attention(
                q, k, v, allowed, bias, dropout_p, chunk_size
            )
            stats = KrigingStats(second_moment, estimate, sum_p_sq, v) if with_stats else None
            return out, None, stats
        return reference_attention(q, k, v, allowed, bias, dropout_p, with_stats, need_weights)


class KrigingAttention(nn.Module):
    """Multi-head softmax attention whose keys carry a precision bias.

    With ``gate="sigmoid"`` the heads' outputs are multiplied elementwise by
    ``sigmoid(x W_g)`` before ``W_O`` (gated attention, Qiu et al. 2025).
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dropout: float = 0.0,
        gate: str | None = None,
        impl: str = "reference",
        chunk_size: int = 256,
    ) -> None:
        super().__init__()
        check_int("d_model", d_model)
        check_heads(d_model, nhead)
        check_dropout("dropout", dropout)
        if gate not in (None, "sigmoid"):
            raise ValueError(f"attention_gate must be None or 'sigmoid', got {gate!r}")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
        check_int("attention_chunk", chunk_size)
        self.d_model, self.nhead, self.dropout, self.impl = d_model, nhead, dropout, impl
        self.chunk_size = chunk_size
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d_model))
        self.out_proj = nn.Linear(d_model, d_model)
        self.gate = nn.Linear(d_model, d_model) if gate == "sigmoid" else None
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.out_proj.bias)

    @property
    def value_weight(self) -> Tensor:
        """W_V: (d, d)."""
        return self.in_proj_weight[2 * self.d_model :]

    def forward(
        self,
        x: Tensor,
        allowed: Tensor,
        bias: Tensor | None = None,
        with_stats: bool = False,
        need_weights: bool = False,
        project: bool = True,
    ) -> tuple[Tensor, Tensor | None, KrigingStats | None, Tensor | None]:
        """x: (B, T, d) normed input; allowed: (B, 1, T, T); bias: (B, H, T).

        Returns ``z = W_O e`` (B, T, d), the weights (B, H, T, T) or None, the
        statistics or None, and the gate values (B, T, d) or None. With
        ``project=False``, ``e`` itself: the heads' outputs side by side before
        ``W_O`` (head ``a`` in channels ``a d_h .. (a + 1) d_h - 1``, gated if a
        gate is set), for a per-head factor applied before ``out_proj``.
        """
        b, t, d = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, self.nhead, -1).transpose(1, 2) for y in (q, k, v))  # (B,H,T,dh)
        drop = self.dropout if self.training else 0.0
        out, weights, stats = attend(
            q, k, v, allowed, bias, drop, self.impl, self.chunk_size, with_stats, need_weights
        )
        out = out.to(v.dtype).transpose(1, 2).reshape(b, t, d)  # (B, T, d)
        gate = None
        if self.gate is not None:
            gate = torch.sigmoid(self.gate(x))
            out = out * gate
        if project:
            out = self.out_proj(out)
        return out, weights if need_weights else None, stats, gate
