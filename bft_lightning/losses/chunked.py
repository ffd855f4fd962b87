"""Exact full-softmax cross-entropy over item chunks: memory that does not grow with the catalogue.

The logits of a target row are ``z = (h . w_i + b_i) * s`` over items ``i``
(``s`` the precision head's per-row scale, 1 for ``head="dot"``; item 0, the
padding, at ``-inf``). The loss is ``logsumexp_i z_i - z_target``.

The forward pass walks the items in chunks of ``chunk`` and keeps, per row,
only the running maximum and sum of exponentials (an online logsumexp) and
the target's logit. The backward pass walks the chunks again, recomputes each
chunk's logits, turns them into ``softmax - onehot`` and accumulates the
gradients of the states, of that chunk's item weights and biases, and of the
scale. No ``(N, items)`` tensor exists at any time: the largest intermediates
are a few ``(N, chunk)`` blocks; the item weights' gradient has the weights'
own size. The price is computing the logits twice (about 4/3 of the full
softmax's matrix work).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender

from .base import NoFrequency, check_int


def _chunk_logits(
    h: Tensor, weights: Tensor, bias: Tensor | None, scale: Tensor | None, a: int, b: int
) -> tuple[Tensor, Tensor]:
    """Unscaled ``z`` and scaled logits of items ``a..b-1``, ``(N, b - a)`` each."""
    z = h @ weights[a:b].t()
    if bias is not None:
        z = z + bias[a:b]
    if a == 0:  # the padding item is never a candidate
        z[:, 0] = float("-inf")
    return z, z if scale is None else z * scale[:, None]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``(h @ W.T + b) * s`` against ``target``, chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: Tensor,
        weights: Tensor,
        bias: Tensor | None,
        scale: Tensor | None,
        target: Tensor,
        chunk: int,
    ) -> Tensor:
        n, items = h.shape[0], weights.shape[0]
        stat = torch.promote_types(h.dtype, torch.float32)  # the running sums' dtype
        top = torch.full((n,), float("-inf"), dtype=stat, device=h.device)
        total = torch.zeros(n, dtype=stat, device=h.device)
        for a in range(0, items, chunk):
            _, logits = _chunk_logits(h, weights, bias, scale, a, min(a + chunk, items))
            logits = logits.to(stat)
            new_top = torch.maximum(top, logits.max(dim=1).values)
            shift = new_top.nan_to_num(neginf=0.0)  # a chunk of the padding alone: all -inf
            total = total * torch.exp(top - shift) + torch.exp(logits - shift[:, None]).sum(1)
            top = new_top
        lse = top + torch.log(total)
        picked = (h * weights[target]).sum(1)
        if bias is not None:
            picked = picked + bias[target]
        if scale is not None:
            picked = picked * scale
        ctx.save_for_backward(h, weights, bias, scale, target, lse)
        ctx.chunk = chunk
        return (lse - picked.to(stat)).mean()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        h, weights, bias, scale, target, lse = ctx.saved_tensors
        n, items, chunk = h.shape[0], weights.shape[0], ctx.chunk
        need_h, need_w, need_b, need_s = ctx.needs_input_grad[:4]
        coef = (grad / n).to(h.dtype)
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.empty_like(weights) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None
        grad_s = torch.zeros_like(scale) if need_s else None
        rows = torch.arange(n, device=h.device)
        for a in range(0, items, chunk):
            b = min(a + chunk, items)
            z, logits = _chunk_logits(h, weights, bias, scale, a, b)
            dlogits = torch.exp(logits - lse[:, None].to(logits.dtype)) * coef  # softmax
            inside = (target >= a) & (target < b)
            dlogits[rows[inside], target[inside] - a] -= coef  # minus the one-hot
            if scale is not None:
                if grad_s is not None:  # padding's z is -inf, its softmax 0
                    grad_s += (dlogits * z.nan_to_num(neginf=0.0)).sum(1)
                dz = dlogits * scale[:, None]
            else:
                dz = dlogits
            if grad_h is not None:
                grad_h += dz @ weights[a:b]
            if grad_w is not None:
                grad_w[a:b] = dz.t() @ h
            if grad_b is not None:
                grad_b[a:b] = dz.sum(0)
        return grad_h, grad_w, grad_b, grad_s, None, None


def chunked_cross_entropy(
    h: Tensor,
    weights: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    scale: Tensor | None = None,
    chunk: int = 4096,
) -> Tensor:
    """Mean over rows of ``cross_entropy((h @ weights.T + bias) * scale[:, None], target)``
    with column 0 at ``-inf``, never materialising more than ``(N, chunk)`` logits.

    h: ``(N, d)``; weights: ``(items, d)``; target: ``(N,)``; bias: ``(items,)``
    or None; scale: ``(N,)`` or None. Computed in the promoted dtype of ``h``
    and ``weights`` (float32 under autocast), the running sums in at least float32.
    """
    dtype = torch.promote_types(h.dtype, weights.dtype)
    with torch.autocast(h.device.type, enabled=False):
        out = _ChunkedCrossEntropy.apply(
            h.to(dtype),
            weights.to(dtype),
            None if bias is None else bias.to(dtype),
            None if scale is None else scale.to(dtype),
            target,
            chunk,
        )
    return out  # type: ignore[no-any-return]


class ChunkedSoftmax(NoFrequency):
    """``loss="ce_chunked"``: the full softmax's value and gradients, in item chunks.

    Args:
        chunk: items per chunk (the task's ``loss_chunk``). Peak memory of the
            loss is about ``3 x N x chunk`` floats (``N`` targets in a batch)
            plus the item weights' gradient, whatever the catalogue.
    """

    def __init__(self, chunk: int = 4096) -> None:
        self.chunk = check_int("loss_chunk", chunk, 1)

    def __call__(
        self,
        model: SequentialRecommender,
        hidden: Tensor,
        target: Tensor,
        log_prec: Tensor | None,
    ) -> Tensor:
        h, weights = model.output_transform(hidden), model.item_weights()
        bias = model.item_bias()
        scale = model.output_scale(log_prec)
        return chunked_cross_entropy(
            h,
            weights,
            target,
            bias,
            None if scale is None else scale.squeeze(-1),
            self.chunk,
        )
