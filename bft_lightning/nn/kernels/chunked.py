"""Memory-bounded kriging attention: query chunks and a hand-written backward.

The reference path (``attention.reference_attention``) keeps the (B, H, T, S)
weights for autograd, so its memory grows with T^2 per head; the off twin's
fused kernel (``scaled_dot_product_attention``) does not. This path gives the
same values and gradients as the reference while holding only one
(B, H, chunk, S) block at a time, in the forward and in the backward:

- forward: for each block of queries, ``p = softmax(q.k / sqrt(d_h) + bias)``
  over allowed keys, the bias entering the score product itself as one more
  column when the products are exact (``_exact_products``; else it is added
  in the product's accumulator); one product with
  ``[v, ||v||^2 / d_h]`` gives the estimate and the second moment;
  ``sum_j p^2`` is a row reduction of the block (the exact value; the
  log-sum-exp identity of ``docs/spec.md`` (Observe), ``exp(LSE(2s) - 2 LSE(s))``, is
  only needed where a kernel hides ``p``). Only the inputs and the
  (B, H, T, d_h + 1) outputs are saved.
- key spans: with several blocks, each block of queries reads only the keys
  between the first and the last one any of its rows may read
  (``_key_spans``), so a causal mask costs about half the products of a full
  one (block i stops at key i1) and left padding is skipped; a block with no
  allowed key is not computed.
- backward: the block's weights are recomputed and every output's gradient
  is folded into one ``dL/dp``::

      G_j = g_e . [v_j, ||v_j||^2/d_h] + g_out . v_j m_j / keep + 2 g_P p_j
      dL/ds_j = p_j (G_j - sum_k p_k G_k)

  where ``m`` is the dropout mask (regenerated from a per-block seed, so the
  backward sees the forward's mask; ``keep = n / 2^16``, see ``_keep_bits``)
  and ``P = sum_j p^2``, whose derivative is ``dP/ds_j = 2 p_j (p_j - P)``.
  With exact products the row sums ``sum_k p_k G_k`` come from the outputs
  (``g_e . e``, ``g_out . out`` and ``2 g_P P``), not from a pass over the
  block; otherwise from the recomputed block.

Attention dropout is supported; the mask comes from a seed drawn from the
global generator, so ``seed_everything`` makes runs repeatable.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from bft_lightning.nn.kernels.chunks import (
    Span,
    _accumulate,
    _block,
    _covers_all,
    _exact_products,
    _heads_last,
    _keep_bits,
    _keep_factor,
    _key_spans,
    _keys,
    _scaled_queries,
)
from bft_lightning.nn.kernels.reference import KrigingStats


class _ChunkedKriging(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        allowed: Tensor,
        dropout_p: float,
        chunk: int,
        seed: int,
        keep_weights: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        b, h, t, _ = q.shape
        dv = v.shape[-1]
        exact = _exact_products(q)
        in_product = bias is not None and exact  # the bias rides in the score product
        # one copy each into (B, H, T, d_h) order: the products below then read
        # them in place, here and in the backward (q, k, v arrive as transposed
        # views of the input projection, which every product would copy again)
        qs = _scaled_queries(q, in_product)
        k, v = k.contiguous(), v.contiguous()
        kt = _keys(k, bias if in_product else None)
        added = None if in_product else bias  # else added in the product's accumulator
        v_aug = torch.cat([v, v.square().mean(dim=-1, keepdim=True)], dim=-1)
        # one block (T <= chunk): all keys, no span search (rows without a key come
        # out 0 through has_key all the same)
        spans = _key_spans(allowed, chunk) if t > chunk else [(0, t, 0, allowed.shape[-1])]
        whole = _covers_all(spans, t)
        # rows of a block with no key stay 0; a single block writing every row
        # needs no zeros first
        new = q.new_empty if whole else q.new_zeros
        e_aug = new(b, h, t, dv + 1)
        sum_p_sq = new(b, h, t)
        # the output is laid out (B, T, H, d_h), so the caller's merge of the heads
        # into (B, T, d) is a view, not a copy
        out = None
        if dropout_p > 0:
            out = _heads_last(q, dv)
            if not whole:
                out.zero_()
        keep_weights = keep_weights and len(spans) == 1
        kept: list[Tensor | None] = [None, None, None]  # weights, has-key, dropped weights
        for index, span in enumerate(spans):
            i0, i1, s0, s1 = span
            if s0 == s1:
                continue
            p, has_key, scratch = _block(qs, kt, allowed, span, added)
            torch.mul(p @ v_aug[:, :, s0:s1], has_key, out=e_aug[:, :, i0:i1])
            p_sq = torch.mul(p, p, out=scratch).sum(dim=-1)
            torch.mul(p_sq, has_key[..., 0], out=sum_p_sq[:, :, i0:i1])
            dropped = None
            if out is not None:
                # the kept weights unscaled (p m, into the scratch buffer); the factor
                # 2^16 / n goes on the (c x d_h) product
                keep, factor = _keep_bits(p, dropout_p, seed, index, out=scratch)
                dropped = keep.mul_(p)
                torch.mul(dropped @ v[:, :, s0:s1], has_key * factor, out=out[:, :, i0:i1])
            if keep_weights:
                kept = [p, has_key, dropped]
        # the outputs too: the backward's row sums sum_j p_j G_j come from them
        # (sum_j p_j (g_e . [v_j, ..]) = g_e . e, as FlashAttention's rowsum(dO * O))
        # v_aug rather than v: the backward reads v as its view
        ctx.save_for_backward(qs, k, v_aug, bias, allowed, sum_p_sq, e_aug, out, *kept)  # type: ignore[arg-type]
        ctx.set_materialize_grads(False)  # an unused output costs nothing in the backward
        ctx.dropout_p, ctx.spans, ctx.seed = dropout_p, spans, seed  # type: ignore[attr-defined]
        ctx.exact = exact  # type: ignore[attr-defined]
        if out is None:
            out = _heads_last(q, dv).copy_(e_aug[..., :-1])
        # the estimate and the second moment as two outputs (views of e_aug): their
        # gradients arrive apart, with no zero-filled (B, H, T, d_h + 1) tensor each
        return out, e_aug[..., :-1], e_aug[..., -1], sum_p_sq

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        g_out: Tensor | None,
        g_est: Tensor | None,
        g_m2: Tensor | None,
        g_p: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # type: ignore[attr-defined]
        qs, k, v_aug, bias, allowed, sum_p_sq, e_aug, out = saved[:8]
        kept_p, kept_has_key, kept_dropped = saved[8:]  # None unless one block was kept
        dropout_p: float = ctx.dropout_p  # type: ignore[attr-defined]
        spans: list[Span] = ctx.spans  # type: ignore[attr-defined]
        seed: int = ctx.seed  # type: ignore[attr-defined]
        exact: bool = ctx.exact  # type: ignore[attr-defined]
        in_product = bias is not None and exact
        added = None if in_product else bias
        dh, dv = k.shape[3], v_aug.shape[3] - 1
        scale = 1.0 / math.sqrt(dh)
        factor = _keep_factor(dropout_p)
        q_like = qs[..., :dh]  # the shape of q's gradient
        # the keys only to recompute weights
        kt = _keys(k, bias if in_product else None) if kept_p is None else k
        v = v_aug[..., :-1]
        # gradients start as None: a block that covers the whole tensor sets it
        # (no zeros, no copy), others add into zeros (_accumulate)
        dq: Tensor | None = None
        dk: Tensor | None = None
        dv_aug: Tensor | None = None
        dbias: Tensor | None = None
        needs_grad: tuple[bool, ...] = ctx.needs_input_grad  # type: ignore[attr-defined]
        want_bias = bias is not None and needs_grad[3]
        # the gradient of [estimate, second moment] as one (B, H, T, d_h + 1) tensor
        g_e: Tensor | None = None
        fold = g_out is not None and dropout_p == 0
        if g_est is not None or g_m2 is not None or fold:
            g_e = q_like.new_empty(*q_like.shape[:3], dv + 1)
            for part, grad in ((g_e[..., :-1], g_est), (g_e[..., -1], g_m2)):
                if grad is None:
                    part.zero_()
                else:
                    part.copy_(grad)
        if fold and g_e is not None and g_out is not None:
            # without dropout the output is the estimate: one product serves both
            g_e[..., :-1] += g_out
            g_out = None
        for index, span in enumerate(spans):
            i0, i1, s0, s1 = span
            if s0 == s1:
                continue
            dropped: Tensor | None = None
            scratch: Tensor | None = None
            if kept_p is not None and kept_has_key is not None:
                p, has_key, dropped = kept_p, kept_has_key, kept_dropped
            else:
                p, has_key, scratch = _block(qs, kt, allowed, span, added)
            # dL/ds = p * (G - c) with G_j = A_j + 2 g_P p_j + m_j f B_j and
            # c = sum_k p_k G_k, where A = g_e [v, ||v||^2/d_h]^T, B = g_out v^T and
            # m f the dropout multiplier (bits m, factor f): the dropout term is
            # (p m) * (f B), so no float mask is formed and the factor goes on g_out.
            # With exact products c is read off the outputs: sum_k p_k A_k = g_e . e
            # and sum_k p_k m_k f B_k = g_out . out, (c x d_h) dot products, no (c x s)
            # pass; otherwise it is summed over the recomputed block (_exact_products)
            grad_s: Tensor | None = None  # A, then A + 2 g_P p: what multiplies p
            c: Tensor | None = None
            if g_e is not None:
                ge = g_e[:, :, i0:i1] * has_key
                grad_s = ge @ v_aug[:, :, s0:s1].transpose(-1, -2)
                dv_aug = _accumulate(dv_aug, v_aug, (s0, s1), p.transpose(-1, -2) @ ge)
                if exact:
                    c = torch.linalg.vecdot(ge, e_aug[:, :, i0:i1])
            if g_p is not None:
                gp2 = (2.0 * g_p[:, :, i0:i1, None]) * has_key  # (B, H, c, 1)
                grad_s = p * gp2 if grad_s is None else grad_s.addcmul_(p, gp2)
                if exact:
                    from_p = gp2[..., 0] * sum_p_sq[:, :, i0:i1]
                    c = from_p if c is None else c.add_(from_p)
            if not exact and grad_s is not None:
                c = torch.linalg.vecdot(p, grad_s)
            from_out = None
            if g_out is not None:  # with dropout (otherwise folded into g_e above)
                assert out is not None
                # contiguous, so both products below read it in place (g_out comes
                # heads last, from the merge of the heads after this function)
                go = torch.mul(
                    g_out[:, :, i0:i1], has_key * factor, out=p.new_empty(*p.shape[:3], dv)
                )
                if dropped is None:
                    dropped = _keep_bits(p, dropout_p, seed, index, out=scratch)[0].mul_(p)
                dv_aug = _accumulate(
                    dv_aug, v_aug, (s0, s1), dropped.transpose(-1, -2) @ go, channels=dv
                )
                from_out = go @ v[:, :, s0:s1].transpose(-1, -2)
                if exact:
                    c_out = torch.linalg.vecdot(g_out[:, :, i0:i1], out[:, :, i0:i1])
                else:
                    c_out = torch.linalg.vecdot(dropped, from_out)
                c = c_out if c is None else c.add_(c_out)
            if c is None:
                continue
            if grad_s is None:
                ds = p * c.neg_().unsqueeze(-1)
            else:
                ds = grad_s.sub_(c.unsqueeze(-1)).mul_(p)
            if dropped is not None and from_out is not None:
                ds.addcmul_(dropped, from_out)
            # the gradients of q and k laid out heads last, as the input projection's
            # output they flow back into (so autograd merges their heads as a view);
            # ds^T @ qs is the keys' gradient (qs holds q / sqrt(d_h)) and, with a
            # bias, the bias gradient sum_i ds in its last column
            dq = _accumulate(
                dq, q_like, (i0, i1), ds @ k[:, :, s0:s1], scale=scale, heads_last=True
            )
            dk_b = ds.transpose(-1, -2) @ qs[:, :, i0:i1]
            dk = _accumulate(dk, k, (s0, s1), dk_b[..., :dh], heads_last=True)
            if want_bias:
                assert bias is not None
                d_b = dk_b[..., dh] if in_product else ds.sum(-2)
                dbias = _accumulate(dbias, bias, (s0, s1), d_b, rows_dim=-1)
        if dq is None:
            dq = _heads_last(q_like).zero_()
        if dk is None:
            dk = _heads_last(k).zero_()
        if want_bias and dbias is None:
            dbias = torch.zeros_like(bias)
        grad_v = _heads_last(v)
        if dv_aug is None:
            grad_v.zero_()
        else:  # through ||v||^2 / d_h too
            torch.addcmul(dv_aug[..., :-1], dv_aug[..., -1:], v, value=2.0 / dv, out=grad_v)
        return dq, dk, grad_v, dbias, None, None, None, None, None


@torch.compiler.disable  # the Python block loop and the per-block RNG would break graphs anyway
def chunked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    bias: Tensor | None,
    dropout_p: float,
    chunk_size: int = 256,
    keep_weights: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Kriging attention in query blocks of ``chunk_size``; same values as the reference.

    q: (B, H, T, d_h); k, v: (B, H, S, d_h); allowed: (B, 1, T, S) bool; bias:
    (B, H, S) per key or None. Returns the output with dropout (B, H, T, d_h),
    the estimate ``sum_j p v_j`` (B, H, T, d_h), the second moment
    ``sum_j p ||v_j||^2 / d_h`` (B, H, T) and ``sum_j p^2`` (B, H, T); rows with
    no allowed key give 0 everywhere. The output is a view laid out heads last
    (so that merging the heads is a view too). The outputs are kept for the
    backward, and the output and the estimate are views: none of them may be
    modified in place (autograd raises); ``clone()`` first.

    ``keep_weights``: keep the weights (and, with dropout, the dropped weights
    ``p m``) of a call that is one block (T <= ``chunk_size``) for the backward
    instead of recomputing them: the reference path's memory (B, H, T, S) twice
    with dropout (at most one block, ``chunk_size`` rows), for less time
    (``results/perf/notes.md``). Calls of several blocks always recompute. The
    same on every device (no device-dependent path).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    seed = int(torch.randint(0, 2**62, (1,), device="cpu").item()) if dropout_p > 0 else 0
    # under autocast the kept weights would be in the autocast dtype while the
    # backward's incoming gradients are not: recompute there
    keep_weights = keep_weights and not torch.is_autocast_enabled(q.device.type)
    out, estimate, second_moment, sum_p_sq = _ChunkedKriging.apply(
        q, k, v, bias, allowed, float(dropout_p), int(chunk_size), seed, bool(keep_weights)
    )
    return out, estimate, second_moment, sum_p_sq


def kriging(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor | None,
    dropout_p: float, chunk_size: int,
) -> tuple[Tensor, KrigingStats]:  # fmt: skip
    """The kernel interface (``nn.kernels``) of the chunked path: output and statistics."""
    out, estimate, second_moment, sum_p_sq = chunked_attention(
        q, k, v, allowed, bias, dropout_p, chunk_size
    )
    return out, KrigingStats(second_moment, estimate, sum_p_sq, v)
