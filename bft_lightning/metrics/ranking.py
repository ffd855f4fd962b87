"""Full-ranking metrics for next-item recommendation: HR@k, NDCG@k, MRR, by stratum.

Rank and tie rule
-----------------
Item 0 is padding. The 0-based rank of the target ``t`` for one user is

    rank = #{ j : j != 0, j != t, j not excluded, s_j >= s_t }

i.e. ties are PESSIMISTIC: every other item scoring at least as high as the
target counts above it. A model that scores all N - 1 real items equally gets
``rank = N - 2`` and HR@k = 0 (for k < N - 1). NaN scores raise ``ValueError``.
Low-precision scores (fp16/bf16) tie more often and so rank lower: compute
evaluation scores in float32.

Per-user values (rank ``r``)
----------------------------
    HR@k   = 1[r < k]
    NDCG@k = 1[r < k] / log2(r + 2)       (one relevant item, so IDCG = 1)
    MRR    = 1 / (r + 1)                  (full, NOT truncated at any k)

Key scheme of ``RankingMetric.compute()`` (a flat ``dict[str, float]``)
-----------------------------------------------------------------------
    "hr@{k}", "ndcg@{k}"  for k in ``ks``;  "mrr";  "n" (users counted)
    "gain"                mean of the per-user scalar (e.g. Kalman gain K),
                          only when some user was given one
    "item_q{j}/<name>"    the same names over users whose TARGET item is in
                          popularity quartile j (0 = rarest .. 3), see strata.py
    "user_b{j}/<name>"    over users in history-length bucket j (0 = cold)

Every stratum is always reported; an empty one has ``n = 0`` and NaN means.
Means are over users: ``hr@10 = sum_u HR@10(u) / n``.

DDP exactness
-------------
States are per-user tensors of length ``num_users`` (rank, target, history
length, gain), initialised to -1 / -inf and combined with ``max`` both inside
a process (``scatter_reduce(amax)``) and across processes (torchmetrics
``dist_reduce_fx="max"``). A user repeated by ``DistributedSampler`` padding
writes the same values twice, so it is counted once and 1 process equals N
processes exactly for the same scores (a model may score a user differently in
the last bits when its batch differs, which can flip a rank at a near-tie).
Memory: 4 x 8 bytes per evaluation user.

Top-k path
----------
``faiss_topk`` (exact ``IndexFlatIP``) and ``torch_topk_chunked`` (on a CPU
through ``torch_topk_tiled``: cache-sized score tiles reduced to group maxima
at once, the tiles computed in bfloat16 where the CPU multiplies it in hardware
and the candidates they choose rescored in float32 under a proven error bound,
so the result is the float32 top-k) return the top-k item ids per user with
padding excluded; ``ranks_from_topk`` turns them
into ranks clipped at k, which give the same HR/NDCG@k' (k' <= k) as the full
path on tie-free scores. The timings behind these choices: ``results/perf/notes.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric

from bft_lightning.metrics.strata import (
    NUM_STRATA,
    assign_item_stratum,
    assign_user_bucket,
    history_buckets,
    popularity_quartiles,
)

DEFAULT_KS: tuple[int, ...] = (1, 5, 10, 20)
RANK_BLOCK = 4096  # columns compared at a time by ``target_ranks``
TOPK_GROUP = 64  # columns per group of the group-max prefilter of ``topk_rows``
TILE_USERS = 512  # users per score tile of ``torch_topk_tiled``
TILE_COLUMNS = 4096  # about the columns per score tile (8 MB in float32 with 512 users)
TILE_GROUP = 8  # columns per group of the tiled prefilter
RESCORE_ELEMENTS = 1 << 22  # candidate vector elements gathered at a time (16 MB in float32)


# ----------------------------------------------------------------------------- ranks
def _check_rank_inputs(scores: Tensor, target: Tensor, exclude: Tensor | None) -> None:
    if scores.ndim != 2 or target.shape != scores.shape[:1]:
        raise ValueError(
            f"scores (B, N) and target (B,) expected, got {scores.shape}, {target.shape}"
        )
    # a row's max is NaN iff the row holds a NaN: one reduction, no (B, N) mask
    if scores.numel() and torch.isnan(scores.amax(dim=1)).any():
        raise ValueError("scores contain NaN; ranks are undefined (check the model output)")
    if target.numel() and (target.min() < 1 or target.max() >= scores.shape[1]):
        raise ValueError(f"target ids must be in 1..{scores.shape[1] - 1} (0 is padding)")
    if exclude is not None and exclude.shape != scores.shape:
        raise ValueError(f"exclude must have the shape of scores {tuple(scores.shape)}")


def target_ranks(scores: Tensor, target: Tensor, exclude: Tensor | None = None) -> Tensor:
    """0-based pessimistic rank of each target among all real items.

    ``rank_b = #{j : j != 0, j != t_b, not exclude[b, j], s_bj >= s_bt}``. Column 0
    (padding) never counts; ``exclude`` (B, N) bool (e.g. the user's history)
    removes items from the count, except the target itself.

    Args:
        scores: (B, N) float, N = num_items + 1 (column 0 = padding). No NaN.
        target: (B,) long, ids in ``1..N-1``.
        exclude: optional (B, N) bool.
    Returns:
        (B,) long ranks in ``0..N-2``.
    """
    _check_rank_inputs(scores, target, exclude)
    t_idx = target.long()[:, None]  # (B, 1)
    t_score = scores.gather(1, t_idx)  # (B, 1)
    if exclude is None:
        # count in column blocks with an int32 sum: the (B, block) comparison stays
        # in cache and no int64 copy of a (B, N) mask is made (faster than summing
        # one bool matrix: results/perf/notes.md); then take out the padding column and the
        # target itself (>= itself, as no score is NaN)
        n = scores.shape[1]
        count = torch.zeros(scores.shape[0], dtype=torch.int32, device=scores.device)
        for j in range(0, n, RANK_BLOCK):
            count += (scores[:, j : j + RANK_BLOCK] >= t_score).sum(1, dtype=torch.int32)
        count -= (scores[:, :1] >= t_score).squeeze(1).int() + 1
        return count.long()  # (B,)
    above = scores >= t_score  # (B, N) ties count above (pessimistic)
    above[:, 0] = False  # padding
    above &= ~exclude.bool()
    above.scatter_(1, t_idx, False)  # the target is not above itself
    return above.sum(1)  # (B,)


def hr_ndcg_mrr(ranks: Tensor, ks: Sequence[int] = DEFAULT_KS) -> dict[str, Tensor]:
    """Per-user HR@k, NDCG@k (k in ``ks``) and full MRR from 0-based ranks (U,).

    ``HR@k = 1[r < k]``, ``NDCG@k = 1[r < k] / log2(r + 2)``, ``MRR = 1 / (r + 1)``.
    Returns float64 tensors (U,) keyed ``"hr@k"``, ``"ndcg@k"``, ``"mrr"``.
    """
    r = ranks.double()  # (U,)
    out: dict[str, Tensor] = {}
    for k in ks:
        hit = r < k
        out[f"hr@{k}"] = hit.double()
        out[f"ndcg@{k}"] = torch.where(hit, 1.0 / torch.log2(r + 2.0), torch.zeros_like(r))
    out["mrr"] = 1.0 / (r + 1.0)
    return out


# ----------------------------------------------------------------------------- summaries
def _masked_means(values: dict[str, Tensor], gain: Tensor, mask: Tensor, prefix: str) -> dict:
    """Means of per-user ``values`` over ``mask``; NaN when the stratum is empty."""
    n = int(mask.sum())
    out = {
        f"{prefix}{name}": float(v[mask].sum() / n) if n else math.nan for name, v in values.items()
    }
    out[f"{prefix}n"] = float(n)
    if gain.numel():  # gain given: users without one hold -inf and are skipped
        g = gain[mask & (gain > -math.inf)]
        out[f"{prefix}gain"] = float(g.mean()) if g.numel() else math.nan
    return out


def summarise_ranks(
    ranks: Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    item_stratum: Tensor | None = None,
    user_bucket: Tensor | None = None,
    gain: Tensor | None = None,
) -> dict[str, float]:
    """Flat metric dict (module docstring key scheme) from per-user ranks (U,).

    ``item_stratum`` / ``user_bucket`` (U,) long in 0..3 add ``item_q{j}/`` and
    ``user_b{j}/`` entries; ``gain`` (U,) float (-inf = none) adds ``gain``.
    """
    values = hr_ndcg_mrr(ranks, ks)  # each (U,)
    g = gain.double() if gain is not None else torch.empty(0, dtype=torch.float64)
    everyone = torch.ones_like(ranks, dtype=torch.bool)
    out = _masked_means(values, g, everyone, "")
    for name, stratum in (("item_q", item_stratum), ("user_b", user_bucket)):
        if stratum is None:
            continue
        for j in range(NUM_STRATA):
            out.update(_masked_means(values, g, stratum == j, f"{name}{j}/"))
    return out


# ----------------------------------------------------------------------------- metric
class RankingMetric(Metric):
    """DDP-exact full-ranking HR/NDCG/MRR, overall and per item / user stratum.

    Args:
        num_users: number of evaluation users; ``user`` ids in ``update`` are in
            ``0..num_users-1`` (a dataset index, so sampler padding duplicates share it).
        item_frequency: (num_items + 1,) training counts; enables ``item_q{j}/`` keys.
        item_boundaries: (3,) popularity cut points; default ``popularity_quartiles``.
        user_boundaries: (3,) history-length cut points. Default: computed at
            ``compute()`` from the history lengths of all users seen (i.e. the whole
            evaluation set, identical on every rank). Enables ``user_b{j}/`` keys
            whenever ``history_len`` is passed to ``update``.
        ks: cut-offs for HR@k and NDCG@k.

    Each evaluation user is one sample (its last item as target). A user id seen
    twice must carry the same data (sampler padding does); otherwise each state
    keeps its maximum. Call ``reset()`` between evaluations.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    rank: Tensor  # (num_users,) states, see the module docstring
    target: Tensor
    history_len: Tensor
    gain: Tensor
    item_frequency: Tensor | None  # non-persistent buffers
    item_boundaries: Tensor | None
    user_boundaries: Tensor | None

    def __init__(
        self,
        num_users: int,
        item_frequency: Tensor | None = None,
        item_boundaries: Tensor | None = None,
        user_boundaries: Tensor | None = None,
        ks: Sequence[int] = DEFAULT_KS,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.num_users = int(num_users)
        self.ks = tuple(int(k) for k in ks)
        if item_frequency is not None and item_boundaries is None:
            item_boundaries = popularity_quartiles(item_frequency)
        self.register_buffer("item_frequency", item_frequency, persistent=False)
        self.register_buffer("item_boundaries", item_boundaries, persistent=False)
        self.register_buffer("user_boundaries", user_boundaries, persistent=False)
        for name, fill, dtype in (
            ("rank", -1, torch.long),
            ("target", -1, torch.long),
            ("history_len", -1, torch.long),
            ("gain", -math.inf, torch.float64),
        ):
            self.add_state(name, torch.full((self.num_users,), fill, dtype=dtype), "max")

    def _put(self, state: str, user: Tensor, value: Tensor) -> None:
        """state[user] = max(state[user], value), duplicates included."""
        buf = getattr(self, state)
        buf.scatter_reduce_(0, user, value.detach().to(buf.dtype), reduce="amax")

    def update(
        self,
        scores: Tensor,
        target: Tensor,
        user: Tensor,
        history_len: Tensor | None = None,
        gain: Tensor | None = None,
        exclude: Tensor | None = None,
    ) -> None:
        """Add a batch: scores (B, N), target (B,), user (B,) ids, history_len (B,), gain (B,).

        ``exclude`` (B, N) bool optionally masks items out of the ranking (see
        :func:`target_ranks`).
        """
        user = user.long()
        if user.numel() and (user.min() < 0 or user.max() >= self.num_users):
            raise ValueError(f"user ids must be in 0..{self.num_users - 1}")
        self._put("rank", user, target_ranks(scores.detach(), target, exclude))
        self._put("target", user, target.long())
        if history_len is not None:
            self._put("history_len", user, history_len.long())
        if gain is not None:
            if torch.isnan(gain).any():
                raise ValueError("gain contains NaN")
            self._put("gain", user, gain.reshape(-1))

    def compute(self) -> dict[str, float]:  # type: ignore[override]
        """Flat ``dict[str, float]``; see the module docstring for the keys."""
        seen = self.rank >= 0  # (num_users,)
        ranks, target, hist, gain = (
            t[seen] for t in (self.rank, self.target, self.history_len, self.gain)
        )
        return summarise_ranks(
            ranks,
            self.ks,
            item_stratum=self._item_stratum(target),
            user_bucket=self._user_bucket(hist),
            gain=gain if bool((gain > -math.inf).any()) else None,
        )

    def _item_stratum(self, target: Tensor) -> Tensor | None:
        if self.item_frequency is None or self.item_boundaries is None:
            return None
        return assign_item_stratum(target, self.item_frequency, self.item_boundaries)

    def _user_bucket(self, hist: Tensor) -> Tensor | None:
        if hist.numel() == 0 or bool((hist < 0).any()):
            return None  # history lengths were not given for every user
        bounds = self.user_boundaries
        return assign_user_bucket(hist, bounds if bounds is not None else history_buckets(hist))


# ----------------------------------------------------------------------------- top-k paths
def _as_f32(x: Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)


def _real_items(
    item_vecs: Tensor, k: int, exclude_padding: bool, user_vecs: Tensor
) -> tuple[Tensor, int]:
    """The items that can be returned (without padding row 0) and the id offset;
    refuses NaN in either input, which would make the top-k undefined (faiss
    returns id -1 for such a user, a float top-k puts a NaN item first)."""
    for name, x in (("user_vecs", user_vecs), ("item_vecs", item_vecs)):
        if x.numel() and torch.isnan(x.amax()):  # a max is NaN iff a value is
            raise ValueError(f"{name} contain NaN; the top-k is undefined (check the model)")
    offset = 1 if exclude_padding else 0
    items = item_vecs[offset:]  # (N', d)
    if not 1 <= k <= items.shape[0]:
        raise ValueError(f"k must be in 1..{items.shape[0]}, got {k}")
    return items, offset


def faiss_topk(
    user_vecs: Tensor, item_vecs: Tensor, k: int, exclude_padding: bool = True
) -> tuple[Tensor, Tensor]:
    """Exact inner-product top-k with faiss ``IndexFlatIP``.

    ``s_ui = <user_u, item_i>``; row 0 of ``item_vecs`` (padding) is left out
    unless ``exclude_padding=False``. Returns scores (U, k) float32 and item ids
    (U, k) long, best first. Thread count: ``faiss.omp_set_num_threads``.
    """
    import faiss  # local import: only this path needs it

    items, offset = _real_items(item_vecs, k, exclude_padding, user_vecs)
    index = faiss.IndexFlatIP(items.shape[1])
    index.add(_as_f32(items))
    scores, ids = index.search(_as_f32(user_vecs), k)  # (U, k) each
    return torch.from_numpy(scores), torch.from_numpy(ids).long() + offset


def torch_topk_chunked(
    user_vecs: Tensor,
    item_vecs: Tensor,
    k: int,
    chunk: int = 4096,
    exclude_padding: bool = True,
    tiled: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Inner-product top-k in user chunks: peak memory ``chunk x N`` scores.

    Same contract as :func:`faiss_topk`; scores have the dtype of the inputs.
    ``tiled`` (default: on a CPU) takes :func:`torch_topk_tiled`, which never
    holds a chunk's scores; ``chunk`` then does not apply.
    """
    if tiled is None:
        tiled = user_vecs.device.type == "cpu"
    if tiled:
        return torch_topk_tiled(user_vecs, item_vecs, k, exclude_padding=exclude_padding)
    items, offset = _real_items(item_vecs, k, exclude_padding, user_vecs)
    items_t = items.T.contiguous()  # (d, N'): one layout for every chunk's GEMM
    vals, ids = [], []
    for u in user_vecs.split(chunk):  # (c, d)
        v, i = topk_rows(u @ items_t, k)  # (c, k)
        vals.append(v)
        ids.append(i + offset)
    return torch.cat(vals), torch.cat(ids)


def _tile_layout(n: int, group: int, tile_columns: int) -> tuple[int, int]:
    """(tiles, groups per tile) covering as many of ``n`` columns as whole groups allow."""
    tiles = max(1, -(-n // tile_columns))
    return tiles, n // (tiles * group)


@functools.cache
def fast_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or
    AMX), where a bfloat16 GEMM runs faster than a float32 one, and its
    bfloat16 products accumulate in float32 (:func:`bf16_matmul_accumulates_in_float32`)."""
    probes = [getattr(torch.cpu, name, None) for name in _BF16_PROBES]
    found = any(probe is not None and probe() for probe in probes)
    return found and bf16_matmul_accumulates_in_float32()


@functools.cache
def bf16_matmul_accumulates_in_float32() -> bool:
    """Whether a CPU bfloat16 matrix product stays within the error bound of float32
    accumulation plus one rounding to bfloat16, which :func:`torch_topk_tiled`'s
    screen relies on (checked once on random 64 x 160 x 256 inputs)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 160, generator=g).bfloat16()
    b = torch.randn(160, 256, generator=g).bfloat16()
    exact = a.double() @ b.double()  # products of bfloat16 values are exact in float64
    got = (a @ b).double()
    gamma = 2.0 * _accumulation_gamma(a.shape[1])
    bound = gamma * (a.double().abs() @ b.double().abs()) + _ROUND_BF16 * got.abs()
    return bool(((got - exact).abs() <= bound).all())


_BF16_PROBES = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
# rounding x to bfloat16 moves it by <= 2^-8 |x| (to nearest), < 1.008 2^-7 |x| (truncated)
_ROUND_BF16 = 2.0**-7 * 1.01
SCREEN_EXTRA = 14  # groups beyond k rescored after a bfloat16 screen: max(this, k)
# the screen by default from this many items, and at least this many per unit of k: its
# rescoring of 2k groups costs more than the float32 GEMMs it saves below (timings in
# results/perf/notes.md)
SCREEN_MIN_ITEMS = 32768
SCREEN_ITEMS_PER_K = 2000
SCREEN_SAMPLE = 256  # items scored exactly to centre each user's screened scores


def _accumulation_gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u), u = 2^-24: the relative error bound of a float32
    sum of n terms (relative to the sum of their magnitudes)."""
    nu = n * 2.0**-24
    return nu / (1.0 - nu)


def _screen_applies(users: Tensor, items: Tensor, screen: bool | None, k: int) -> bool:
    if screen is False or users.dtype != torch.float32 or items.dtype != torch.float32:
        return False
    n = items.shape[0]
    if screen is None and (
        users.device.type != "cpu"
        or n < max(SCREEN_MIN_ITEMS, SCREEN_ITEMS_PER_K * k)
        or not fast_bf16_matmul()
    ):
        return False
    if screen and users.device.type != "cpu":
        raise ValueError(
            "screen=True is for CPU tensors: the bound it relies on is checked for CPU "
            "bfloat16 products (a GPU's may reduce in bfloat16); use screen=None or False"
        )
    if screen and not bf16_matmul_accumulates_in_float32():
        raise ValueError(
            "screen=True: this CPU's bfloat16 matrix product exceeds the float32 "
            "accumulation error bound the screen relies on; use screen=None or False"
        )
    # non-finite or huge vectors: the error bound does not hold (the float32 path then
    # returns what it returns for them)
    scale = users.abs().amax() * items.abs().amax() * users.shape[1]
    return bool(torch.isfinite(scale) and scale < 1e30)


@torch.no_grad()
def torch_topk_tiled(
    user_vecs: Tensor,
    item_vecs: Tensor,
    k: int,
    exclude_padding: bool = True,
    tile_users: int = TILE_USERS,
    tile_columns: int = TILE_COLUMNS,
    group: int = TILE_GROUP,
    screen: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Inner-product top-k that never holds more than one cache-sized tile of scores.

    Same contract as :func:`faiss_topk`. A score matrix of ``chunk x N`` is
    written to and read back from main memory, and a fresh one per chunk
    costs page faults besides: GEMMs into fresh chunks ran at a fraction of
    the rate of the same GEMMs into one reused cache-sized tile
    (``results/perf/notes.md``). So the scores are made a tile
    (``tile_users x ~tile_columns``) at a time into one reused buffer, and each
    tile is reduced at once to group maxima: a tile's columns are cut into
    ``stride`` groups of ``group`` columns each, group ``r`` of tile ``t``
    holding columns ``t W + r + m stride`` (``m < group``, ``W = group x
    stride``), so a group's maximum is an elementwise max over ``group`` rows
    of the tile's (group, stride) view, which vectorises. The top-k lies in
    the k groups with the largest maxima (the argument of :func:`topk_rows`:
    groups may be any partition of the columns); those ``k x group`` columns
    are scored again from their item vectors (a batched product, in the
    order of the tile's GEMM up to float rounding; the vectors are gathered
    ``RESCORE_ELEMENTS`` at a time, so a large k costs no more memory) and the
    top k taken; the columns past the last whole group are always candidates.

    **bfloat16 screen** (``screen``; by default on a CPU that multiplies
    bfloat16 in hardware, :func:`fast_bf16_matmul`, for float32 inputs): the
    tiles are computed from bfloat16 copies of the vectors, which is faster,
    and only choose the groups to rescore; the result is still that of the
    float32 path (``screen=False``), because the screen's error is bounded for each user and a user
    whose bound does not settle its top k is rescored in full. With
    ``u = u~ + r_u`` and ``v = v~ + r_v`` (bfloat16 values and their
    residuals), ``u.v = u~.v~ + u~.r_v + r_u.v``, so the screened score is
    within ``A_u = |u~| max|r_v| + |r_u| max|v|`` of the exact one, plus the
    float32 accumulation (``gamma_{d+1}`` of the magnitudes, doubled) and the
    rounding of the tile to bfloat16 (``1.01 x 2^-7 |s~|``, twice the
    round-to-nearest bound). Each user's scores are centred (one more column,
    ``-tau``, against a row of ones) on the j-th best of ``SCREEN_SAMPLE``
    items scored exactly, j chosen so that ``tau`` ranks ~4k among all items:
    the scores near the top k are then small and so is their rounding. The
    tile's group maxima are taken over its bits as int16 (see
    ``_Screen.select``). The k-th largest screened group maximum less its
    bound is a lower bound ``L`` of the exact k-th score (each of those k
    groups holds an item scoring at least that); a group can hold a top-k
    item only if its maximum plus its bound reaches ``L``. The ``k +
    max(SCREEN_EXTRA, k)`` best groups are rescored; a user whose next group
    still could reach ``L`` (near-ties wider than the bound) is scored against
    all items in float32, a tile at a time. The default takes the screen from
    ``SCREEN_MIN_ITEMS`` items and ``SCREEN_ITEMS_PER_K`` per unit of k, where
    it was measured to pay (``results/perf/notes.md``; below that the rescoring
    of 2k groups costs more than the GEMM time it saves). Tests: the same sets as
    the float32 path and a float64 reference, crowded near-ties that take the
    fallback, the bound against every score of the tile products.

    Equal to a top-k over the full product except in which of equally scored
    columns is returned and, as between any two GEMMs, for scores within
    float rounding of each other (tests against the full top-k and faiss).
    """
    if min(tile_users, tile_columns, group) < 1:
        raise ValueError("tile_users, tile_columns and group must be >= 1")
    items, offset = _real_items(item_vecs, k, exclude_padding, user_vecs)
    dtype = torch.promote_types(user_vecs.dtype, items.dtype)
    users, items = user_vecs.to(dtype), items.to(dtype)
    n, d = items.shape
    tiles, stride = _tile_layout(n, group, tile_columns)
    groups = tiles * stride
    if groups < 4 * k or users.shape[0] == 0:  # too few groups for the prefilter to pay
        return torch_topk_chunked(
            user_vecs, item_vecs, k, exclude_padding=exclude_padding, tiled=False
        )
    width = group * stride  # columns of a tile
    covered = tiles * width  # columns in whole groups; the rest are always candidates
    dev = users.device
    # columns of group g = t * stride + r: t W + r + m stride, m < group
    cols_of = (
        torch.arange(tiles, device=dev)[:, None, None] * width
        + torch.arange(stride, device=dev)[None, :, None]
        + torch.arange(group, device=dev)[None, None, :] * stride
    ).reshape(groups, group)  # (G, group)
    by_group = items[cols_of]  # (G, group, d): the items in group order, gathered once
    items_t = items.T.contiguous()  # (d, N')
    tail = torch.arange(covered, n, device=dev)  # (n - covered,)
    screened = _screen_applies(users, items, screen, k)
    if screened:
        scr = _Screen(items, k, min(groups, k + max(SCREEN_EXTRA, k)))
        tile_items_t, picked = scr.items_t, scr.picked
    else:
        tile_items_t, picked = items_t, k
    buf = torch.empty(tile_users, width, dtype=tile_items_t.dtype, device=dev)
    # screened: the bfloat16 tile's bits as int16, whose maximum is faster than a
    # bfloat16 one and orders every group with a non-negative value right (_Screen)
    reduced = buf.view(torch.int16) if screened else buf
    maxima = torch.empty(tile_users, tiles, stride, dtype=reduced.dtype, device=dev)
    vals, ids = [], []
    for u0 in range(0, users.shape[0], tile_users):
        u = users[u0 : u0 + tile_users]  # (c, d)
        c = u.shape[0]
        if screened:
            tu, bound = scr.block(u)  # bfloat16 (c, d + 1) and each user's bound
        else:
            tu = u
        tile, red = buf[:c], reduced[:c]
        for t in range(tiles):
            torch.mm(tu, tile_items_t[:, t * width : (t + 1) * width], out=tile)  # (c, W)
            torch.amax(red.view(c, group, stride), dim=1, out=maxima[:c, t])  # (c, stride)
        settled = None
        if screened:
            best, settled = scr.select(maxima[:c].view(c, groups), bound)
        else:
            best = topk_rows(maxima[:c].view(c, groups), k)[1]  # (c, k) group ids
        per = max(1, RESCORE_ELEMENTS // (picked * group * d))  # users per gather
        # each user's row against its candidates: (1, d) @ (d, k group), a product the
        # CPU BLAS runs faster than the same sums as (k group, d) @ (d, 1)
        cand = torch.cat(
            [
                torch.bmm(v.unsqueeze(1), by_group[b].flatten(1, 2).transpose(1, 2)).squeeze(1)
                for b, v in zip(best.split(per), u.split(per))
            ]
        )  # (c, k group)
        cols = cols_of[best].flatten(1)  # (c, k group)
        if covered < n:
            cand = torch.cat([cand, u @ items_t[:, covered:]], dim=1)
            cols = torch.cat([cols, tail.expand(c, -1)], dim=1)
        v, j = cand.topk(k, dim=1)
        j = cols.gather(1, j)
        if settled is not None and not bool(settled.all()):
            rows = (~settled).nonzero().squeeze(1)  # near-ties wider than the bound
            v[rows], j[rows] = _topk_over_tiles(u[rows], items_t, k, width)
        vals.append(v)
        ids.append(j + offset)
    return torch.cat(vals), torch.cat(ids)


def _topk_over_tiles(u: Tensor, items_t: Tensor, k: int, width: int) -> tuple[Tensor, Tensor]:
    """The top k of ``u @ items_t`` (c, N) from the top k of each tile of ``width``
    columns: float32 scores of every column, one (c, width) tile held at a time."""
    n = items_t.shape[1]
    buf = u.new_empty(u.shape[0], min(width, n))
    vals, cols = [], []
    for j0 in range(0, n, width):
        w = min(width, n - j0)
        v, i = torch.mm(u, items_t[:, j0 : j0 + w], out=buf[:, :w]).topk(min(k, w), dim=1)
        vals.append(v)
        cols.append(i + j0)
    v, pos = torch.cat(vals, dim=1).topk(k, dim=1)
    return v, torch.cat(cols, dim=1).gather(1, pos)


class _Screen:
    """The bfloat16 screen of :func:`torch_topk_tiled`: the items in bfloat16 with a
    row of ones (d + 1, N), and for each block of users their centred bfloat16
    vectors (c, d + 1) with ``-tau`` and error bounds; the choice of groups to rescore.
    Nothing is held per user beyond one block (item norms are taken in row chunks)."""

    def __init__(self, items: Tensor, k: int, picked: int) -> None:
        n, d = items.shape
        self.k, self.picked = k, picked
        m = min(n, SCREEN_SAMPLE)
        # integer arithmetic: a float32 linspace can round n - 1 up to n past 2^24
        index = torch.arange(m, device=items.device) * (n - 1) // max(m - 1, 1)
        self.sample_t = items[index].T.contiguous()  # (d, m)
        # the centre: the j-th best of m sampled scores ranks ~j n / m among all
        # items, j chosen to put that at ~4k and at least 3 (a centre above the
        # k-th best score would leave the user to the fallback)
        self.j = min(m, max(3, round(4 * k * m / n)))
        ib = items.bfloat16()
        self.items_t = torch.cat([ib.T, ib.new_ones(1, n)]).contiguous()  # (d + 1, N)
        # norms in float64 (exact enough that the bound stays a bound), in row chunks
        v_max = r_max = vb_max = 0.0
        for r0 in range(0, n, 1 << 16):
            x, xb = items[r0 : r0 + (1 << 16)].double(), ib[r0 : r0 + (1 << 16)].double()
            v_max = max(v_max, x.norm(dim=1).max().item())
            vb_max = max(vb_max, xb.norm(dim=1).max().item())
            r_max = max(r_max, x.sub_(xb).norm(dim=1).max().item())  # residuals v - v~
        self.v_max, self.vb_max, self.r_max = v_max, vb_max, r_max
        self.gamma = 2.0 * _accumulation_gamma(d + 1)

    def block(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """Users (c, d) float32 -> their centred bfloat16 vectors (c, d + 1) and
        bounds (c,) float64 (the screened score's error before its own rounding)."""
        d = u.shape[1]
        tau = (u @ self.sample_t).topk(self.j, dim=1).values[:, -1]  # (c,)
        ub = torch.cat([u, -tau[:, None]], dim=1).bfloat16()
        u_b = ub[:, :d].double()
        u_b_norm = u_b.norm(dim=1)
        r_u = u.double().sub_(u_b).norm(dim=1)
        tau_b = ub[:, d].double().abs()
        flushed = (d + 1) * 2.0**-126 * (1.0 + u_b_norm + self.vb_max)  # subnormals -> 0
        accumulated = self.gamma * (u_b_norm * self.vb_max + tau_b)
        return ub, u_b_norm * self.r_max + r_u * self.v_max + accumulated + flushed

    def select(self, maxima: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """The groups to rescore (c, picked) and whether they settle each user's top k.

        ``maxima`` (c, groups) are the int16 maxima of the tile's bfloat16 bits. A
        non-negative bfloat16 value's bits order like the value and every negative
        one's are below them as int16, so a group with a value >= 0 gets its true
        maximum and a group whose maximum is negative some value of it that is
        negative. Ordered by these, the ``picked`` best groups are rescored; the
        bound needs the k-th of them >= 0 (its value then is a group's maximum,
        and so are those of the k - 1 groups above it), and every group outside
        them below ``max(next, 0)`` in screened score.
        """
        c, groups = maxima.shape
        if self.picked >= groups:
            best = maxima.float().topk(groups, dim=1).indices
            return best, torch.ones(c, dtype=torch.bool, device=maxima.device)
        top_bits, top_i = topk_rows(maxima.float(), self.picked + 1)  # int16 values, exact
        bits = top_bits[:, [self.k - 1, self.picked]].to(torch.int16)
        kth, nxt = bits.view(torch.bfloat16).double().unbind(1)
        nxt = nxt.clamp(min=0.0)  # outside groups with no value >= 0 are below 0
        lower = kth - a - _ROUND_BF16 * kth.abs()  # <= the exact k-th score
        upper = nxt + a + _ROUND_BF16 * nxt.abs()  # >= every score outside the picked groups
        # (a negative k-th value never settles anyway: lower < 0 < a <= upper)
        settled = (bits[:, 0] >= 0) & (upper < lower)
        return top_i[:, : self.picked], settled


def topk_rows(scores: Tensor, k: int, group: int = TOPK_GROUP) -> tuple[Tensor, Tensor]:
    """``scores.topk(k, dim=1)`` (values and column ids, best first) via a group-max prefilter.

    The columns are cut into groups of ``group``; a top-k element lies in one of
    the k groups with the largest maxima (a group outside them has k group maxima
    at or above its own max, so none of its elements can be in the top k, up to
    ties), so one ``amax`` pass, a top-k over the group maxima and a top-k over
    ``k * group`` gathered candidates replace a top-k over all N columns, which is
    cheaper on a CPU (``results/perf/notes.md``). The columns after the last whole
    group are always candidates. Equal to ``topk`` except in which of equally
    scored columns is returned.
    """
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    c, n = scores.shape
    whole = n // group
    if whole < 4 * k:  # too few groups for the prefilter to pay
        return scores.topk(k, dim=1)
    maxima = scores[:, : whole * group].unflatten(1, (whole, group)).amax(-1)  # (c, whole)
    best = maxima.topk(k, dim=1).indices  # (c, k)
    offsets = torch.arange(group, device=scores.device)
    cols = (best.unsqueeze(-1) * group + offsets).flatten(1)  # (c, k * group)
    if whole * group < n:
        tail = torch.arange(whole * group, n, device=scores.device).expand(c, -1)
        cols = torch.cat([cols, tail], dim=1)
    v, j = scores.gather(1, cols).topk(k, dim=1)
    return v, cols.gather(1, j)


@torch.no_grad()
def chunked_target_ranks(
    user_vecs: Tensor,
    item_vecs: Tensor,
    target: Tensor,
    chunk: int = 4096,
    tiled: bool | None = None,
) -> Tensor:
    """Full pessimistic ranks (U,) of ``target`` (U,) for dot-product scores, in user chunks.

    Equals ``target_ranks(user_vecs @ item_vecs.T, target)`` without holding U x N scores.
    Every chunk's GEMM writes into one reused buffer (a fresh ``chunk x N`` output per
    chunk costs page faults that, on a CPU, slowed the product). ``tiled``
    (default: on a CPU) takes :func:`tiled_target_ranks`; ``chunk`` then does not apply.
    """
    if tiled is None:
        tiled = user_vecs.device.type == "cpu"
    if tiled:
        return tiled_target_ranks(user_vecs, item_vecs, target)
    dtype = torch.promote_types(user_vecs.dtype, item_vecs.dtype)
    items_t = item_vecs.to(dtype).T.contiguous()  # (d, N)
    buf = user_vecs.new_empty((min(chunk, user_vecs.shape[0]), items_t.shape[1]), dtype=dtype)
    parts = [
        target_ranks(torch.mm(u.to(dtype), items_t, out=buf[: u.shape[0]]), t)  # (c,)
        for u, t in zip(user_vecs.split(chunk), target.split(chunk))
    ]
    return torch.cat(parts)


@torch.no_grad()
def tiled_target_ranks(
    user_vecs: Tensor,
    item_vecs: Tensor,
    target: Tensor,
    tile_users: int = TILE_USERS,
    tile_columns: int = TILE_COLUMNS,
) -> Tensor:
    """Full pessimistic ranks (U,) of ``target`` (U,), a cache-sized score tile at a time.

    ``rank_u = #{j >= 1, j != t_u : s_uj >= s_ut}`` with every score, the target's
    included, taken from the same tile GEMMs (``tile_users x tile_columns``, one reused
    buffer, see :func:`torch_topk_tiled`), so that scores equal in those products (a
    degenerate model's, duplicate items') count against the target as in
    :func:`target_ranks`. The users are sorted by target, so a block of users has its
    targets in few tiles (one or two where users outnumber items): those tiles are
    computed first for the target scores
    (the same call on the same buffers as in the counting pass, hence the same values),
    then every tile adds its count of scores at or above them (the last target tile,
    still in the buffer, without a second product), and the target's own column is
    taken out in the tile that holds it. The same ranks as ``target_ranks``
    on one full product wherever that product's values equal the tiles' (tests, with
    ties and duplicate items). Inputs that are not finite or whose product could
    overflow go through the untiled path, which checks for NaN.
    """
    if min(tile_users, tile_columns) < 1 or tile_columns > 2**24:
        raise ValueError("tile_users must be >= 1 and tile_columns in 1..2^24 (exact counts)")
    n = item_vecs.shape[0]
    if user_vecs.ndim != 2 or item_vecs.ndim != 2 or target.shape != user_vecs.shape[:1]:
        raise ValueError(
            f"user_vecs (U, d), item_vecs (N, d) and target (U,) expected, got "
            f"{tuple(user_vecs.shape)}, {tuple(item_vecs.shape)}, {tuple(target.shape)}"
        )
    if target.numel() and (target.min() < 1 or target.max() >= n):
        raise ValueError(f"target ids must be in 1..{n - 1} (0 is padding)")
    if user_vecs.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=user_vecs.device)
    dtype = torch.promote_types(user_vecs.dtype, item_vecs.dtype)
    users, items = user_vecs.to(dtype), item_vecs.to(dtype)
    if users.numel() and items.numel():
        # |s| <= max|u| max|v| d: below the dtype's largest value, no inf and so no NaN
        bound = float(users.abs().amax()) * float(items.abs().amax()) * users.shape[1]
        if not bound < torch.finfo(dtype).max:  # also False for NaN
            return chunked_target_ranks(user_vecs, item_vecs, target, tiled=False)
    items_t = items[1:].T.contiguous()  # (d, N - 1): real items, column j is item j + 1
    real = items_t.shape[1]
    order = torch.argsort(target, stable=True)  # users by target: few target tiles a block
    tgt = target[order].long() - 1  # (U,) column of each sorted user's target
    users = users[order]
    buf = users.new_empty((tile_users, min(tile_columns, real)))
    wide = torch.promote_types(dtype, torch.float32)
    ranks = torch.empty(users.shape[0], dtype=torch.long, device=users.device)

    def tile_of(u: Tensor, j: int) -> Tensor:  # one call shape per tile, in both passes
        w = min(tile_columns, real - j)
        return torch.mm(u, items_t[:, j : j + w], out=buf[: u.shape[0], :w])  # (c, w)

    def count_into(tile: Tensor, j: int, t_score: Tensor, col: Tensor, counts: Tensor) -> None:
        # the tile becomes its own 0/1 indicator of "at or above the target" in place,
        # and a float row sum counts it, cheaper than a comparison into a bool
        # tensor with an integer sum; exact: a row holds at most 2^24 ones, summed
        # in float32 at least (half precision holds integers only to 256 or 2048)
        # counts: (2, c), the counts at or above the target and the target's own (0 / 1)
        above = tile.ge_(t_score)
        counts[0] += above.sum(1, dtype=wide).long()
        rows = ((col >= j) & (col < j + above.shape[1])).nonzero().squeeze(1)
        if rows.numel():  # the target itself: at or above its own score
            counts[1, rows] = above[rows, col[rows] - j].long()

    for u, col, idx in zip(users.split(tile_users), tgt.split(tile_users), order.split(tile_users)):
        c = u.shape[0]
        t_score = u.new_empty(c, 1)
        counts = torch.zeros(2, c, dtype=torch.long, device=users.device)
        target_tiles = (
            col.div(tile_columns, rounding_mode="floor").unique() * tile_columns
        ).tolist()
        for j in target_tiles:
            tile = tile_of(u, j)
            rows = ((col >= j) & (col < j + tile.shape[1])).nonzero().squeeze(1)
            t_score[rows, 0] = tile[rows, col[rows] - j]
        # the last target tile is still in the buffer, and every target score is known:
        # it is counted now, not computed again
        count_into(tile, target_tiles[-1], t_score, col, counts)
        for j in range(0, real, tile_columns):
            if j != target_tiles[-1]:
                count_into(tile_of(u, j), j, t_score, col, counts)
        ranks[idx] = counts[0] - counts[1]
    return ranks


def ranks_from_topk(ids: Tensor, target: Tensor) -> Tensor:
    """Rank of ``target`` (U,) within top-k ``ids`` (U, k): its position, or k if absent.

    Ranks are clipped at k, so they are exact for HR/NDCG@k' with k' <= k only
    (MRR from them would be truncated).
    """
    k = ids.shape[1]
    match = ids == target[:, None]  # (U, k)
    pos = match.int().argmax(1)  # first match; 0 when none
    return torch.where(match.any(1), pos, torch.full_like(pos, k)).long()


def topk_metrics(ids: Tensor, target: Tensor, ks: Sequence[int] = (10,)) -> dict[str, Tensor]:
    """Per-user ``hr@k`` / ``ndcg@k`` (k in ``ks``, each <= ids.shape[1]) from top-k ids."""
    if max(ks) > ids.shape[1]:
        raise ValueError(f"ks {tuple(ks)} exceed the retrieved k = {ids.shape[1]}")
    per_user = hr_ndcg_mrr(ranks_from_topk(ids, target), ks)
    del per_user["mrr"]  # truncated at k: not the full MRR
    return per_user
