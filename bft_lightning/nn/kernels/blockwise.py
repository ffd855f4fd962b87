"""Blockwise kriging attention: one pass over key blocks with an online softmax.

The same statistics as ``attention.reference_attention`` (and ``nn.chunked``):
for every query ``t`` of every head, with ``p = softmax_j(q_t.k_j / sqrt(d_h)
+ bias_j)`` over the keys it may read,

- the estimate ``e_t = sum_j p_j v_j``,
- the second moment ``M_t = sum_j p_j ||v_j||^2 / d_v``,
- ``P_t = sum_j p_j^2``,
- the output with attention dropout ``o_t = sum_j p_j m_j f v_j`` (``m`` the
  keep mask, ``f`` its factor; the estimate itself without dropout),

and, for the backward, the row's log-sum-exp. As flash attention does, the keys
are read in blocks with a running maximum ``mu`` and running sums rescaled by
``exp(mu_old - mu_new)`` whenever the maximum moves; ``sum_j p_j^2`` is the
running ``sum_j exp(2 (s_j - mu))`` rescaled by the square of that factor and
divided by ``l^2`` at the end (``l = sum_j exp(s_j - mu)``). No (T x S) tensor
exists: one (T x block) block of scores at a time, in the forward and in the
backward, which recomputes ``p_j = exp(s_j - lse)`` per block and folds every
output's gradient into ``dL/ds``::

    G_j = g_e . v_j + g_M ||v_j||^2 / d_v + 2 g_P p_j + f m_j (g_o . v_j)
    c   = g_e . e + g_M M + 2 g_P P + g_o . o          (= sum_j p_j G_j)
    dL/ds_j = p_j (G_j - c)

so the row sums come from the saved outputs, as flash attention's
``rowsum(dO * O)``. Rows with no key give 0 everywhere (``lse = +inf``, so the
recomputed weights are 0 too).

Masks: ``allowed`` (B or 1, 1, T, S) bool as ``attention.build_allowed`` gives
it, or, without any (T x S) mask, ``key_valid`` (B, S) bool and/or
``is_causal`` (query ``i`` reads keys ``j <= i``; then T = S). With a causal
mask, the key block ``s0:s1`` is read by the queries from ``s0`` on only.

Dropout: the keep mask is a counter-based hash of ``(seed, batch * head, query,
key)`` (:func:`keep_mask`), the same numbers whatever the block size and in the
Triton kernel (``kernels.fused_triton``), regenerated in the backward, with the
16-bit keep threshold of ``nn.chunked`` (keep probability ``n / 2^16``, within
``2^-17`` of ``1 - p``, factor ``2^16 / n``: the multiplier's expectation is 1).

The entry point is :func:`blockwise_attention`, a ``torch.library`` custom op
(:func:`define_kriging_op`, with a fake implementation and a registered
backward), so ``torch.compile(fullgraph=True)`` traces through it.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from bft_lightning.nn.kernels.dropout_hash import _M32, keep_mask, keep_threshold, row_streams

DEFAULT_BLOCK = 64  # for d_h = 32; see default_block
Outputs = tuple[Tensor, Tensor, Tensor, Tensor]


def default_block(head_dim: int) -> int:
    """The key block when none is given: ``2 d_h`` within [16, 256]. A block's
    (T x block) temporaries then weigh about as much as the (T x d_h) gradients
    of q, k and v, what the off twin's fused kernel holds (results/perf/kernels.md)."""
    return min(256, max(16, 2 * head_dim))


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    allowed: Tensor | None,
    key_valid: Tensor | None,
    is_causal: bool,
    block: int,
) -> None:
    """Shapes, dtypes and mask options, each with one clear message."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"kriging attention: q, k, v must be (B, H, T, d), got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, h, t, dh = q.shape
    s = k.shape[2]
    if k.shape != (b, h, s, dh) or v.shape[:3] != (b, h, s):
        raise ValueError(
            f"kriging attention: k must be (B, H, S, d_h) = {(b, h, s, dh)} and v "
            f"(B, H, S, d_v), got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.dtype not in (torch.float32, torch.float64) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"kriging attention: q, k, v must share float32 or float64 (the statistics are "
            f"computed in float32), got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if bias is not None and (bias.shape != (b, h, s) or bias.dtype != q.dtype):
        raise ValueError(
            f"kriging attention: bias must be (B, H, S) = {(b, h, s)} in {q.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    if allowed is not None:
        if allowed.dtype != torch.bool or allowed.dim() != 4 or allowed.shape[1:] != (1, t, s):
            raise ValueError(
                f"kriging attention: allowed must be a bool (B, 1, T, S) = {(b, 1, t, s)} "
                f"mask, got {tuple(allowed.shape)} {allowed.dtype}"
            )
        if allowed.shape[0] not in (1, b):
            raise ValueError(f"kriging attention: allowed has batch {allowed.shape[0]}, not {b}")
    if key_valid is not None and (key_valid.dtype != torch.bool or key_valid.shape != (b, s)):
        raise ValueError(
            f"kriging attention: key_valid must be a bool (B, S) = {(b, s)} mask, got "
            f"{tuple(key_valid.shape)} {key_valid.dtype}"
        )
    if is_causal and t != s:
        raise ValueError(f"kriging attention: is_causal needs T == S, got T = {t}, S = {s}")
    if block < 1:
        raise ValueError(f"kriging attention: block_size must be >= 1, got {block}")


def _block_allowed(
    allowed: Tensor | None,
    key_valid: Tensor | None,
    is_causal: bool,
    rows: tuple[int, int],
    cols: tuple[int, int],
) -> Tensor | None:
    """The (B or 1, 1, rows, cols) bool mask of one block, or None when all is allowed."""
    (r0, r1), (c0, c1) = rows, cols
    mask = None if allowed is None else allowed[:, :, r0:r1, c0:c1]
    if key_valid is not None:
        kv = key_valid[:, None, None, c0:c1]
        mask = kv if mask is None else mask & kv
    if is_causal and c1 - 1 > r0:  # some key of the block lies after some query
        device = allowed.device if allowed is not None else None
        if device is None and key_valid is not None:
            device = key_valid.device
        i = torch.arange(r0, r1, device=device)
        j = torch.arange(c0, c1, device=device)
        causal = (j[None, :] <= i[:, None])[None, None]
        mask = causal if mask is None else mask & causal
    return mask


def _first_row(is_causal: bool, c0: int) -> int:
    """The first query that may read key ``c0`` (causal: ``c0``, else 0)."""
    return c0 if is_causal else 0


def _scores(
    q: Tensor, k_blk: Tensor, bias: Tensor | None, mask: Tensor | None, cols: tuple[int, int]
) -> Tensor:
    """``q @ k_blk^T + bias[cols]`` with blocked entries at -inf: (B, H, rows, cols)."""
    c0, c1 = cols
    s = q @ k_blk.transpose(-1, -2)
    if bias is not None:
        s.add_(bias[:, :, None, c0:c1])
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    return s


def blockwise_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    allowed: Tensor | None,
    key_valid: Tensor | None,
    seed: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward pass (no autograd): estimate (B, H, T, d_v), second moment,
    ``sum p^2`` and log-sum-exp (B, H, T; +inf for a row with no key), and the
    output with dropout (B, H, T, d_v; an empty tensor when ``dropout_p == 0``)."""
    b, h, t, dh = q.shape
    s, dv = k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(dh)
    with torch.autocast(q.device.type, enabled=False):
        mu = q.new_full((b, h, t), float("-inf"))
        l_sum = q.new_zeros(b, h, t)
        p2_sum = q.new_zeros(b, h, t)
        acc = q.new_zeros(b, h, t, dv)
        acc_m = q.new_zeros(b, h, t)
        drop = dropout_p > 0
        acc_o = q.new_zeros(b, h, t, dv) if drop else q.new_empty(0)
        threshold, factor = keep_threshold(dropout_p)
        streams = row_streams(_seed_int(seed), b * h, q.device) if drop else None
        for c0 in range(0, s, block):
            c1 = min(s, c0 + block)
            r0 = _first_row(is_causal, c0)
            if r0 >= t:
                break
            mask = _block_allowed(allowed, key_valid, is_causal, (r0, t), (c0, c1))
            v_blk = v[:, :, c0:c1]
            p = _scores(q[:, :, r0:], k[:, :, c0:c1] * scale, bias, mask, (c0, c1))
            mu_old = mu[:, :, r0:]
            mu_new = torch.maximum(mu_old, p.amax(dim=-1))
            # a row with no key so far keeps mu = -inf; its weights are exp(-inf) = 0
            mu_safe = torch.where(torch.isinf(mu_new), torch.zeros_like(mu_new), mu_new)
            alpha = torch.exp(mu_old - mu_safe)
            p.sub_(mu_safe[..., None]).exp_()  # the block's unnormalised weights
            l_sum[:, :, r0:].mul_(alpha).add_(p.sum(dim=-1))
            p2 = torch.linalg.vecdot(p, p)  # (a batched product of 1 x c rows is slow)
            p2_sum[:, :, r0:].mul_(alpha.square()).add_(p2)
            acc[:, :, r0:].mul_(alpha[..., None]).add_(p @ v_blk)
            vsq = v_blk.square().mean(dim=-1)  # (B, H, cols)
            acc_m[:, :, r0:].mul_(alpha).add_((p @ vsq.unsqueeze(-1)).view_as(alpha))
            if streams is not None:
                keep = keep_mask(streams, (r0, t), (c0, c1), s, threshold)
                kept = p.masked_fill_(~keep.view(b, h, t - r0, c1 - c0), 0.0)
                acc_o[:, :, r0:].mul_(alpha[..., None]).add_(kept @ v_blk)
            mu[:, :, r0:] = mu_new
        has = l_sum > 0
        tiny = torch.finfo(q.dtype).tiny
        inv = torch.where(has, 1.0 / l_sum.clamp_min(tiny), 0.0)
        estimate = acc.mul_(inv[..., None])
        second_moment = acc_m.mul_(inv)
        sum_p_sq = p2_sum.mul_(inv.square())
        lse = torch.where(has, mu + torch.log(l_sum.clamp_min(tiny)), torch.inf)
        if drop:
            acc_o.mul_((inv * factor)[..., None])
    return estimate, second_moment, sum_p_sq, lse, acc_o


def _seed_int(seed: Tensor | None) -> int:
    """The dropout seed as a 32-bit Python int (0 without a seed)."""
    return 0 if seed is None else int(seed.reshape(-1)[0].item()) & _M32


def _zeros_if_none(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g


def backward_row_sums(
    g_est: Tensor,
    g_m2: Tensor,
    g_p: Tensor,
    g_out: Tensor | None,
    estimate: Tensor,
    second_moment: Tensor,
    sum_p_sq: Tensor,
    out: Tensor,
) -> Tensor:
    """``c = g_e . e + g_M M + 2 g_P P + g_o . o`` (B, H, T), the row sums of ``p G``."""
    c = torch.linalg.vecdot(g_est, estimate) + g_m2 * second_moment + 2.0 * g_p * sum_p_sq
    if g_out is not None and out.numel():
        c = c + torch.linalg.vecdot(g_out, out)
    return c


def blockwise_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    allowed: Tensor | None,
    key_valid: Tensor | None,
    seed: Tensor | None,
    estimate: Tensor,
    second_moment: Tensor,
    sum_p_sq: Tensor,
    lse: Tensor,
    out: Tensor,
    g_est: Tensor | None,
    g_m2: Tensor | None,
    g_p: Tensor | None,
    g_out: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward pass: dq, dk, dv and d bias (an empty tensor without a bias),
    recomputing the weights per key block (module docstring)."""
    b, h, t, dh = q.shape
    s, dv = k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(dh)
    with torch.autocast(q.device.type, enabled=False):
        g_e = _zeros_if_none(g_est, estimate)
        g_m = _zeros_if_none(g_m2, second_moment)
        g_pp = _zeros_if_none(g_p, sum_p_sq)
        drop = dropout_p > 0 and g_out is not None
        c = backward_row_sums(g_e, g_m, g_pp, g_out if drop else None, estimate,
                              second_moment, sum_p_sq, out)  # fmt: skip
        c = torch.where(torch.isinf(lse), 0.0, c)
        gp2 = 2.0 * g_pp
        threshold, factor = keep_threshold(dropout_p)
        streams = row_streams(_seed_int(seed), b * h, q.device) if drop else None
        go = g_out * factor if drop and g_out is not None else None
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv_out = torch.zeros_like(v)
        dbias = torch.zeros_like(bias) if bias is not None else q.new_empty(0)
        for c0 in range(0, s, block):
            c1 = min(s, c0 + block)
            r0 = _first_row(is_causal, c0)
            if r0 >= t:
                break
            mask = _block_allowed(allowed, key_valid, is_causal, (r0, t), (c0, c1))
            k_blk, v_blk = k[:, :, c0:c1], v[:, :, c0:c1]
            q_rows = q[:, :, r0:]
            p = _scores(q_rows, k_blk * scale, bias, mask, (c0, c1))
            p.sub_(lse[:, :, r0:, None]).exp_()  # the weights, 0 where blocked or empty
            vsq = v_blk.square().mean(dim=-1)  # (B, H, cols)
            # G = g_e v^T + g_M ||v||^2 / d_v + 2 g_P p (+ the dropout term below)
            grad = g_e[:, :, r0:] @ v_blk.transpose(-1, -2)
            grad.addcmul_(g_m[:, :, r0:, None], vsq[:, :, None, :])
            grad.addcmul_(p, gp2[:, :, r0:, None])
            pt = p.transpose(-1, -2)
            # dv = p^T g_e + (p^T g_M) 2 v / d_v
            dv_blk = torch.addcmul(
                pt @ g_e[:, :, r0:], pt @ g_m[:, :, r0:, None], v_blk, value=2.0 / dv
            )
            if streams is not None and go is not None:
                keep = keep_mask(streams, (r0, t), (c0, c1), s, threshold)
                keep = keep.view(b, h, t - r0, c1 - c0)
                from_out = go[:, :, r0:] @ v_blk.transpose(-1, -2)
                grad.add_(from_out.masked_fill_(~keep, 0.0))
                del from_out
                dv_blk.add_(p.masked_fill(~keep, 0.0).transpose(-1, -2) @ go[:, :, r0:])
            ds = grad.sub_(c[:, :, r0:, None]).mul_(p)
            del p, pt
            dq[:, :, r0:].add_(ds @ k_blk)
            dk[:, :, c0:c1] = ds.transpose(-1, -2) @ q_rows
            dv_out[:, :, c0:c1] = dv_blk
            if bias is not None:
                dbias[:, :, c0:c1] = ds.sum(dim=-2)
            del ds, grad
        dq.mul_(scale)
        dk.mul_(scale)
    return dq, dk, dv_out, dbias


ForwardImpl = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]
BackwardImpl = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]


def define_kriging_op(name: str, forward: ForwardImpl, backward: BackwardImpl) -> Any:
    """Register ``bft_lightning::<name>`` (forward) and ``<name>_backward`` as
    ``torch.library`` custom ops with fake implementations, and the backward as
    the forward's autograd formula. ``forward`` and ``backward`` take and return
    what :func:`blockwise_forward` and :func:`blockwise_backward` do."""

    @torch.library.custom_op(f"bft_lightning::{name}", mutates_args=())
    def fwd_op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        allowed: Tensor | None,
        key_valid: Tensor | None,
        seed: Tensor | None,
        is_causal: bool,
        dropout_p: float,
        block: int,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return forward(q, k, v, bias, allowed, key_valid, seed, is_causal, dropout_p, block)

    @fwd_op.register_fake
    def _(q, k, v, bias, allowed, key_valid, seed, is_causal, dropout_p, block):  # type: ignore[no-untyped-def]
        b, h, t, _ = q.shape
        dv = v.shape[-1]
        out = q.new_empty(b, h, t, dv) if dropout_p > 0 else q.new_empty(0)
        rows = q.new_empty(b, h, t)
        return q.new_empty(b, h, t, dv), rows, torch.empty_like(rows), torch.empty_like(rows), out

    @torch.library.custom_op(f"bft_lightning::{name}_backward", mutates_args=())
    def bwd_op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        allowed: Tensor | None,
        key_valid: Tensor | None,
        seed: Tensor | None,
        estimate: Tensor,
        second_moment: Tensor,
        sum_p_sq: Tensor,
        lse: Tensor,
        out: Tensor,
        g_est: Tensor | None,
        g_m2: Tensor | None,
        g_p: Tensor | None,
        g_out: Tensor | None,
        is_causal: bool,
        dropout_p: float,
        block: int,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return backward(q, k, v, bias, allowed, key_valid, seed, estimate, second_moment,
                        sum_p_sq, lse, out, g_est, g_m2, g_p, g_out, is_causal, dropout_p,
                        block)  # fmt: skip

    @bwd_op.register_fake
    def _(q, k, v, bias, *rest):  # type: ignore[no-untyped-def]
        db = torch.empty_like(bias) if bias is not None else q.new_empty(0)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), db

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        q, k, v, bias, allowed, key_valid, seed, is_causal, dropout_p, block = inputs
        ctx.save_for_backward(q, k, v, bias, allowed, key_valid, seed, *output)
        ctx.options = (is_causal, dropout_p, block)
        ctx.has_bias = bias is not None

    def grad_fn(
        ctx: Any, g_est: Tensor | None, g_m2: Tensor | None, g_p: Tensor | None,
        _g_lse: Tensor | None, g_out: Tensor | None,
    ) -> tuple[Tensor | None, ...]:  # fmt: skip
        q, k, v, bias, allowed, key_valid, seed, est, m2, psq, lse, out = ctx.saved_tensors
        is_causal, dropout_p, block = ctx.options
        dq, dk, dv, db = bwd_op(q, k, v, bias, allowed, key_valid, seed, est, m2, psq, lse,
                                out, g_est, g_m2, g_p, g_out if dropout_p > 0 else None,
                                is_causal, dropout_p, block)  # fmt: skip
        return dq, dk, dv, db if ctx.has_bias else None, None, None, None, None, None, None

    fwd_op.register_autograd(grad_fn, setup_context=setup_context)
    return fwd_op


kriging_blockwise_op = define_kriging_op("kriging_blockwise", blockwise_forward, blockwise_backward)


def prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    allowed: Tensor | None,
    dropout_p: float,
    block_size: int,
    key_valid: Tensor | None,
    is_causal: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Checks, float32 for half types, and the dropout seed (an int64 tensor on
    q's device drawn from the global generator, or None)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"kriging attention: dropout_p must be in [0, 1), got {dropout_p}")
    if q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    check_inputs(q, k, v, bias, allowed, key_valid, is_causal, block_size)
    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=q.device)
    return q, k, v, bias, seed


def blockwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    bias: Tensor | None,
    dropout_p: float,
    block_size: int | None = None,
    *,
    key_valid: Tensor | None = None,
    is_causal: bool = False,
) -> Outputs:
    """Kriging attention in key blocks of ``block_size``; the reference's values.

    q: (B, H, T, d_h); k: (B, H, S, d_h); v: (B, H, S, d_v); allowed: (B or 1,
    1, T, S) bool or None; bias: (B, H, S) per key or None; key_valid: (B, S)
    bool or None; is_causal: query ``i`` reads keys ``j <= i``. The masks
    combine (a key is read when every given mask allows it). Half-precision
    inputs are computed in float32. Returns, as ``nn.chunked.chunked_attention``,
    the output with dropout (B, H, T, d_v; the estimate itself when
    ``dropout_p == 0``), the estimate ``sum_j p v_j`` (B, H, T, d_v), the second
    moment ``sum_j p ||v_j||^2 / d_v`` (B, H, T) and ``sum_j p^2`` (B, H, T);
    rows with no allowed key give 0 everywhere. ``block_size``: keys per block
    (None: :func:`default_block`).
    """
    if block_size is None:
        block_size = default_block(q.shape[-1])
    q, k, v, bias, seed = prepare(q, k, v, bias, allowed, dropout_p, block_size, key_valid,
                                  is_causal)  # fmt: skip
    est, m2, psq, _, out = kriging_blockwise_op(
        q, k, v, bias, allowed, key_valid, seed, is_causal, float(dropout_p), int(block_size)
    )
    return (out if dropout_p > 0 else est), est, m2, psq


def kriging(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor | None,
    dropout_p: float, chunk_size: int,
) -> tuple[Tensor, Any]:  # fmt: skip
    """The kernel interface (``nn.kernels``): output and ``KrigingStats``.

    ``chunk_size`` (the query block of the chunked kernel) is not used: the key
    block is this kernel's own default.
    """
    from bft_lightning.nn.kernels.reference import KrigingStats

    out, estimate, second_moment, sum_p_sq = blockwise_attention(q, k, v, allowed, bias, dropout_p)
    return out, KrigingStats(second_moment, estimate, sum_p_sq, v)
