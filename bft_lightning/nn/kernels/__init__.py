"""Attention kernels behind one dispatch point (``docs/spec.md``, Attention implementations).

A layer names its kernel with one explicit option, ``attention_impl``
(``FilterConfig.attention_impl``); :func:`attend` is the only place that picks
code by that name, from :data:`KERNELS`. The name ``"auto"`` is resolved there
too (:func:`resolve`): ``"blockwise"`` while ``torch.compile`` traces the call
(its custom ops stay in one graph; ``"chunked"``'s hand-written backward breaks
the graph), ``"chunked"`` in eager mode. The two give the same values and
gradients, so a model compiled or not needs no option changed.

The kernel interface. A :class:`Kernel` has two functions:

``kriging(q, k, v, allowed, bias, dropout_p, chunk_size) -> (out, stats)``
    precision-weighted (kriging) softmax attention with the filter's statistics.

    - q: (B, H, T, d_h); k, v: (B, H, S, d_h), float32 (the dispatch upcasts
      them and turns autocast off: the statistics are float32);
    - allowed: (B, 1, T, S) bool, the keys a query may read (a row may be empty);
    - bias: (B, H, S) float32 per-key logit bias ``log lambda_bar_j``, or None;
    - dropout_p: attention dropout on the weights of ``out`` (not on the
      statistics); chunk_size: a block size the kernel may use or ignore.
    - out: (B, H, T, d_h) ``sum_j drop(p)_j v_j`` (0 for an empty row);
    - stats: :class:`KrigingStats` from the weights before dropout:
      ``estimate`` (B, H, T, d_h), ``second_moment`` (B, H, T)
      ``sum_j p ||v_j||^2 / d_h``, ``sum_p_sq`` (B, H, T) ``sum_j p^2`` (0 for an
      empty row), ``values`` = ``v``.

    It must give the reference's values and gradients (with respect to q, k, v
    and bias); ``tests/nn/test_chunked.py`` is the pattern of the test.

``plain(q, k, v, allowed, dropout_p) -> out`` (optional)
    attention with no bias and no statistics (the off twin), (B, H, T, d_h);
    None means ``kriging``'s output serves (the reference does so).

A call that asks for the weights (recording, the attention-sink monitor)
always takes the reference, which materialises them.

To add a kernel: a module here with its ``kriging`` function, and one line in
:data:`KERNELS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from bft_lightning.nn.functional import upcast
from bft_lightning.nn.kernels import blockwise, chunked, fused_triton, reference
from bft_lightning.nn.kernels.reference import KrigingStats, reference_attention, sdpa_attention

KrigingKernel = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor | None, float, int], tuple[Tensor, KrigingStats]
]
PlainKernel = Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]


@dataclass(frozen=True)
class Kernel:
    """One attention kernel: its kriging function and, optionally, a plain one."""

    kriging: KrigingKernel
    plain: PlainKernel | None = None


KERNELS: dict[str, Kernel] = {
    "reference": Kernel(reference.kriging),
    "chunked": Kernel(chunked.kriging, plain=sdpa_attention),
    "sdpa": Kernel(reference.kriging, plain=sdpa_attention),
    # one pass over key blocks with an online softmax, no T x S block stored (custom ops)
    "blockwise": Kernel(blockwise.kriging, plain=sdpa_attention),
    # the same algorithm as Triton kernels on CUDA (blockwise on a CPU tensor)
    "fused": Kernel(fused_triton.kriging, plain=sdpa_attention),
}

AUTO = "auto"
__all__ = ["AUTO", "KERNELS", "Kernel", "KrigingStats", "attend", "impl_names", "resolve"]


def impl_names() -> tuple[str, ...]:
    """The values of ``attention_impl``: ``"auto"`` and the names in :data:`KERNELS`
    (read at the call, so a kernel registered later is one too)."""
    return (AUTO, *KERNELS)


def resolve(impl: str) -> str:
    """The kernel that runs for ``impl``: ``"auto"`` -> ``"blockwise"`` under
    ``torch.compile``, else ``"chunked"``; any other name is itself."""
    if impl != AUTO:
        return impl
    return "blockwise" if torch.compiler.is_compiling() else "chunked"


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
    """One attention call by kernel name ``impl``: the kernel switch of every layer.

    q: (B, H, T, d_h); k, v: (B, H, S, d_h); allowed: (B, 1, T, S); bias:
    (B, H, S) or None. Returns the output (B, H, T, d_h), the weights
    (B, H, T, S) before dropout with ``need_weights`` (else None) and the
    statistics with ``with_stats`` (else None). The statistics are float32 on
    every kernel, also under autocast.
    """
    if impl not in impl_names():
        raise ValueError(f"attention_impl must be one of {impl_names()}, got {impl!r}")
    kernel = KERNELS[resolve(impl)]
    if need_weights:  # only the reference materialises the weights
        if with_stats:
            q, k, v = upcast(q), upcast(k), upcast(v)
            bias = None if bias is None else upcast(bias)
        with torch.autocast(q.device.type, enabled=not with_stats and _autocast(q)):
            return reference_attention(q, k, v, allowed, bias, dropout_p, with_stats, True)
    if not with_stats and bias is None:
        if kernel.plain is not None:
            return kernel.plain(q, k, v, allowed, dropout_p), None, None
        out, _, _ = reference_attention(q, k, v, allowed, None, dropout_p, False, False)
        return out, None, None
    q, k, v = upcast(q), upcast(k), upcast(v)
    bias = None if bias is None else upcast(bias)
    with torch.autocast(q.device.type, enabled=False):
        out, stats = kernel.kriging(q, k, v, allowed, bias, dropout_p, chunk_size)
    return out, None, stats if with_stats else None


def _autocast(x: Tensor) -> bool:
    return torch.is_autocast_enabled(x.device.type)
