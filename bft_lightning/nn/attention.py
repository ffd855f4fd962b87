"""Attention for BFT layers: softmax (kriging) attention, its masks and the gated baseline.

``KrigingAttention`` mirrors ``torch.nn.MultiheadAttention``'s parameter names
(``in_proj_weight``, ``in_proj_bias``, ``out_proj``) so that weights copy
across by ``load_state_dict``. The kernel is chosen by one option (``impl``,
a name of ``nn.kernels.KERNELS``) at one dispatch point, ``nn.kernels.attend``
(``docs/spec.md``, Attention implementations).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bft_lightning.nn.checks import check_choice, check_dropout, check_heads, check_int
from bft_lightning.nn.kernels import KrigingStats, attend, impl_names
from bft_lightning.nn.kernels.reference import reference_attention

__all__ = ["KrigingAttention", "KrigingStats", "attend", "build_allowed", "reference_attention"]


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
        check_choice("attention_impl", impl, impl_names())
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
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None, KrigingStats | None, Tensor | None]:
        """x: (B, T, d) normed input; allowed: (B, 1, T, T); bias: (B, H, T).

        ``last_only``: the query of the last position only (keys and values of
        every position), ``allowed`` (B, 1, 1, T); the outputs have one position.

        Returns ``z = W_O e`` (B, T, d), the weights (B, H, T, T) or None, the
        statistics or None, and the gate values (B, T, d) or None. With
        ``project=False``, ``e`` itself: the heads' outputs side by side before
        ``W_O`` (head ``a`` in channels ``a d_h .. (a + 1) d_h - 1``, gated if a
        gate is set), for a per-head factor applied before ``out_proj``.
        """
        b, t, d = x.shape
        w, b_in = self.in_proj_weight, self.in_proj_bias
        if last_only:  # the keys and values of every position, the query of the last
            k, v = F.linear(x, w[d:], b_in[d:]).chunk(2, dim=-1)
            x = x[:, -1:]
            q = F.linear(x, w[:d], b_in[:d])
        else:
            q, k, v = F.linear(x, w, b_in).chunk(3, dim=-1)
        tq = q.shape[1]
        q = q.view(b, tq, self.nhead, -1).transpose(1, 2)  # (B, H, Tq, dh)
        k, v = (y.view(b, t, self.nhead, -1).transpose(1, 2) for y in (k, v))  # (B, H, T, dh)
        drop = self.dropout if self.training else 0.0
        out, weights, stats = attend(
            q, k, v, allowed, bias, drop, self.impl, self.chunk_size, with_stats, need_weights
        )
        out = out.to(v.dtype).transpose(1, 2).reshape(b, tq, d)  # (B, Tq, d)
        gate = None
        if self.gate is not None:
            gate = torch.sigmoid(self.gate(x))
            out = out * gate
        if project:
            out = self.out_proj(out)
        return out, weights if need_weights else None, stats, gate
