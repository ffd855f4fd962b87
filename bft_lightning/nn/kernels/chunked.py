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

from bft_lightning.nn.functional import mask_bias
from bft_lightning.nn.kernels.reference import KrigingStats, masked_value

Span = tuple[int, int, int, int]  # queries i0:i1 read keys s0:s1


def _key_spans(allowed: Tensor, chunk: int) -> list[Span]:
    """Blocks of ``chunk`` queries with the key range ``s0:s1`` each may read.

    allowed: (B, 1, T, S). ``s0:s1`` runs from the first to the last key any
    row of the block (in any sequence) may read; ``s0 == s1`` when none. One
    host sync for all blocks.
    """
    t, s = allowed.shape[-2:]
    starts = list(range(0, t, chunk))
    if t == 0 or s == 0:
        return [(i0, min(t, i0 + chunk), 0, 0) for i0 in starts]
    rows = allowed.any(dim=1).any(dim=0)  # (T, S)
    pad = len(starts) * chunk - t
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, s)])
    cols = rows.view(len(starts), chunk, s).any(dim=1)  # (n, S)
    some = cols.any(dim=1)
    first = cols.int().argmax(dim=1)
    last = s - cols.flip(1).int().argmax(dim=1)
    spans = torch.stack([first, last, some.int()], dim=1).tolist()
    return [
        (i0, min(t, i0 + chunk), s0, s1) if any_ else (i0, min(t, i0 + chunk), 0, 0)
        for i0, (s0, s1, any_) in zip(starts, spans, strict=True)
    ]


def _block(
    qs: Tensor, kt: Tensor, allowed: Tensor, span: Span, bias: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Weights (B, H, c, s1 - s0) of queries ``i0:i1`` over keys ``s0:s1``, the
    queries' has-key flag (B, 1, c, 1) and a free buffer of the weights' shape
    (the scores', which the softmax leaves unused: scratch for the caller, so
    that a block allocates one (c x s) tensor less; on a CPU each fresh one
    costs page faults).

    qs, kt: the scaled queries and the keys as :func:`_scaled_queries` and
    :func:`_keys` lay them out once for all blocks; one product gives the
    scores with the bias added when it rides in them, else ``bias`` (B, H, S)
    is added in the product's accumulator (``baddbmm``, in the inputs' dtype).
    """
    i0, i1, s0, s1 = span
    b, h, _, dq = qs.shape
    s = s1 - s0
    c = i1 - i0
    qc = qs[:, :, i0:i1].reshape(b * h, c, dq)
    if bias is None:
        scores = torch.bmm(qc, kt[:, :, s0:s1])
    else:
        base = bias[..., s0:s1].reshape(b * h, 1, s).to(qc.dtype).expand(b * h, c, s)
        scores = torch.baddbmm(base, qc, kt[:, :, s0:s1])
    block = allowed[:, :, i0:i1, s0:s1]
    scores = scores.view(b, h, c, s)
    if scores.dtype in (torch.float32, torch.float64):
        # the mask as an additive 0 / -1e30 bias (mask_bias: on a CPU, PyTorch's bool
        # kernels, masked_fill with a mask broadcast over heads and any, ran slower
        # than a cast, a row sum and an add: results/perf/notes.md); s - 1e30 rounds
        # to -1e30 (MASKED, the reference's fill)
        bias, has_key = mask_bias(block, scores.dtype)  # (B, 1, c, s), (B, 1, c, 1)
        scores.add_(bias)
    else:  # half types: -1e30 would overflow, the fill is the dtype's lowest
        scores.masked_fill_(~block, masked_value(scores.dtype))
        has_key = block.any(dim=-1, keepdim=True).to(scores.dtype)
    return torch.softmax(scores, dim=-1), has_key, scores


def _scaled_queries(q: Tensor, with_bias: bool) -> Tensor:
    """``q / sqrt(d_h)`` as a contiguous (B, H, T, d_h) tensor, with a column of
    ones appended when a bias is given: against :func:`_keys`' bias row, the
    score product then adds the bias itself (no pass over the (T x S) scores to
    scale them or to add it), and in the backward ``ds^T @ qs`` gives the keys'
    gradient and, in its last column, the bias gradient ``sum_i ds``."""
    b, h, t, dh = q.shape
    qs = q.new_empty(b, h, t, dh + int(with_bias))
    torch.mul(q, 1.0 / math.sqrt(dh), out=qs[..., :dh])
    if with_bias:
        qs[..., dh] = 1.0
    return qs


def _exact_products(x: Tensor) -> bool:
    """Whether this call's products run at the full precision of float32 / float64
    inputs: no autocast, and IEEE float32 products (:func:`_full_precision_matmul`:
    no TF32 on CUDA, no bfloat16 passes on a CPU). Only then does the bias ride
    in the score product (a large log-precision bias rounded to TF32 would move
    the scores by ~1e-2) and does the backward read its row sums off the saved
    outputs, which must then equal what the recomputed weights give; otherwise
    the bias is added in the product's float32 accumulator and the row sums are
    taken from the recomputed weights, as exact as the products allow."""
    return (
        x.dtype in (torch.float32, torch.float64)
        and not torch.is_autocast_enabled(x.device.type)
        and _full_precision_matmul(x.device.type)
    )


def _full_precision_matmul(device_type: str) -> bool:
    """Whether float32 products run in full precision (IEEE) on ``device_type``.

    The legacy ``get_float32_matmul_precision`` raises once the precision was set
    through the per-backend ``fp32_precision`` settings (PyTorch's newer API,
    e.g. ``torch.backends.cuda.matmul.fp32_precision = "tf32"``); then the
    device's own backend setting decides ("none" defers to the global one).
    """
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:
        pass
    backend = torch.backends.cuda.matmul if device_type == "cuda" else torch.backends.mkldnn.matmul  # type: ignore[attr-defined]
    precision = getattr(backend, "fp32_precision", "none")
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision in ("ieee", "none")


def _keys(k: Tensor, bias: Tensor | None) -> Tensor:
    """The keys as (B * H, d_h, S), with the per-key bias as an extra row (d_h + 1)."""
    b, h, s, dh = k.shape
    if bias is None:
        return k.reshape(b * h, s, dh).transpose(1, 2)
    kb = k.new_empty(b, h, s, dh + 1)
    kb[..., :dh] = k
    kb[..., dh] = bias
    return kb.view(b * h, s, dh + 1).transpose(1, 2)


def _covers_all(spans: list[Span], t: int) -> bool:
    """Whether one block computes every query row (a single block with keys)."""
    return len(spans) == 1 and spans[0][0] == 0 and spans[0][1] == t and spans[0][2] < spans[0][3]


def _heads_last(like: Tensor, d: int | None = None) -> Tensor:
    """An empty (B, H, T, d) tensor (``like``'s shape, or its last dim ``d``) laid
    out as (B, T, H, d): the heads of a gradient or an output then merge into
    (B, T, H d) as a view, not a copy."""
    b, h, t, d_like = like.shape
    return like.new_empty(b, t, h, d_like if d is None else d).transpose(1, 2)


def _accumulate(
    buf: Tensor | None,
    like: Tensor,
    rows: tuple[int, int],
    value: Tensor,
    rows_dim: int = 2,
    channels: int | None = None,
    scale: float = 1.0,
    heads_last: bool = False,
) -> Tensor:
    """``buf[rows] += scale * value`` along ``rows_dim`` (and the first ``channels``
    of the last dim, or all of it). On first use ``buf`` is allocated like ``like``
    (laid out heads last with ``heads_last``): zeros, unless ``value`` covers all
    of it, which is then written without zeros first (a single block)."""
    r0, r1 = rows
    if buf is None:
        covers = channels is None and value.shape == like.shape
        buf = _heads_last(like) if heads_last else torch.empty_like(like)
        if covers:
            return torch.mul(value, scale, out=buf)
        buf.zero_()
    view = buf.narrow(rows_dim, r0, r1 - r0)
    if channels is not None:
        view = view[..., :channels]
    view.add_(value, alpha=scale)
    return buf


_MASK_LEVELS = 1 << 16  # the keep probability's resolution: 16 random bits per weight


def _keep_factor(dropout_p: float) -> float:
    """The kept weights' factor ``2^16 / n`` (0 when nothing is kept)."""
    n = round((1.0 - dropout_p) * _MASK_LEVELS)
    return _MASK_LEVELS / n if n else 0.0


def _keep_bits(
    p: Tensor, dropout_p: float, seed: int, index: int, out: Tensor | None = None
) -> tuple[Tensor, float]:
    """The dropout mask of one block as 0 / 1 in ``p``'s dtype (1 = kept; written into
    ``out`` when given) and the kept weights' factor.

    The mask is drawn twice (forward, and again in the backward, unless a
    one-block call kept it), so its cost counts double: each 64-bit draw gives four 16-bit
    uniforms, four times fewer draws than ``torch.rand``. An element is kept when
    its 16-bit value is below ``n = round(keep * 2^16)``, so the keep probability
    is ``n / 2^16`` (within ``2^-17`` of ``1 - dropout_p``) and the kept weights are scaled by
    ``2^16 / n``: the expectation of the multiplier is exactly 1. The comparison
    writes floats directly (a bool result and a product with it are slower on a
    CPU). Timings: ``results/perf/notes.md``.
    """
    out = torch.empty_like(p) if out is None else out
    gen = torch.Generator(device=p.device)
    gen.manual_seed(seed + index)
    n = round((1.0 - dropout_p) * _MASK_LEVELS)
    if n == 0:
        return out.zero_(), 0.0
    if n == _MASK_LEVELS:  # dropout_p below 2^-17: every weight kept (the threshold
        return out.fill_(1.0), 1.0  # 2^15 would not fit in int16)
    count = p.numel()
    words = torch.empty((count + 3) // 4, dtype=torch.int64, device=p.device)
    words.random_(-(2**63), None, generator=gen)  # the full 64-bit range
    bits = words.view(torch.int16)[:count].view(p.shape)  # uniform on -2^15 .. 2^15 - 1
    threshold = n - _MASK_LEVELS // 2  # P(bits < threshold) = n / 2^16
    return torch.lt(bits, threshold, out=out), _MASK_LEVELS / n


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
