"""The parts of the chunked kernel (``nn.kernels.chunked``): query blocks and their
key spans, the operand layouts, the gradient buffers and the dropout bits.

Shapes: ``B`` batch, ``H`` heads, ``T`` queries, ``S`` keys, ``c`` the queries
of a block, ``d_h`` the head width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bft_lightning.nn.functional import mask_bias
from bft_lightning.nn.kernels.reference import masked_value

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
