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
    "<name>_seen_masked"  (or ``_unmasked``) the same metrics under the other
                          evaluation convention, when ``update`` was given its
                          ranks too (``ranks_other``); see "Two conventions"

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

Two conventions
---------------
The field's published tables (RecBole's full sort, BSARec, the SASRec
benchmarks) exclude each user's already-seen items from the ranking; a repeat
of an item is a legitimate target in other data. Evaluation therefore counts
both ranks from the same scores (:func:`bft_lightning.retrieval.ranks_both_ways`):
``protocol`` names the convention of the unsuffixed keys (``"unmasked"``, the
default, or ``"seen_masked"``), and the other one's metrics carry its suffix
(``hr@10_seen_masked`` or ``hr@10_unmasked``), strata included. ``n`` and
``gain`` are the same users' and are not repeated.

Where ranks come from
---------------------
Evaluation ranks through :func:`bft_lightning.retrieval.target_ranks`, which
counts the same ranks from tiles of the scores (no users x items matrix or
mask); :func:`target_ranks` here is the definition on a full score matrix,
which that path is tested against and falls back to. ``RankingMetric.update``
takes either scores or ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
PROTOCOLS = ("unmasked", "seen_masked")  # seen items kept in / excluded from the ranking
RANK_BLOCK = 4096  # columns compared at a time by ``target_ranks``


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
        protocol: the evaluation convention of the ranks ``update`` is given
            (``"unmasked"`` or ``"seen_masked"``); ranks of the other one
            (``ranks_other``) are reported under its suffix.

    Each evaluation user is one sample (its last item as target). A user id seen
    twice must carry the same data (sampler padding does); otherwise each state
    keeps its maximum. Call ``reset()`` between evaluations.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    rank: Tensor  # (num_users,) states, see the module docstring
    rank_other: Tensor  # the other convention's ranks (-1 where not given)
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
        protocol: str = "unmasked",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self.num_users = int(num_users)
        self.ks = tuple(int(k) for k in ks)
        self.protocol = protocol
        other = PROTOCOLS[1 - PROTOCOLS.index(protocol)]
        self.other_suffix = f"_{other}"
        if item_frequency is not None and item_boundaries is None:
            item_boundaries = popularity_quartiles(item_frequency)
        self.register_buffer("item_frequency", item_frequency, persistent=False)
        self.register_buffer("item_boundaries", item_boundaries, persistent=False)
        self.register_buffer("user_boundaries", user_boundaries, persistent=False)
        for name, fill, dtype in (
            ("rank", -1, torch.long),
            ("rank_other", -1, torch.long),
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
        scores: Tensor | None,
        target: Tensor,
        user: Tensor,
        history_len: Tensor | None = None,
        gain: Tensor | None = None,
        exclude: Tensor | None = None,
        ranks: Tensor | None = None,
        ranks_other: Tensor | None = None,
    ) -> None:
        """Add a batch: scores (B, N), target (B,), user (B,) ids, history_len (B,), gain (B,).

        ``exclude`` (B, N) bool optionally masks items out of the ranking (see
        :func:`target_ranks`). Or, with ``scores=None``, the targets' ``ranks`` (B,)
        long as :func:`bft_lightning.retrieval.target_ranks` counts them, and
        optionally ``ranks_other`` (B,), the same targets' ranks under the other
        convention (see "Two conventions").
        """
        user = user.long()
        if user.numel() and (user.min() < 0 or user.max() >= self.num_users):
            raise ValueError(f"user ids must be in 0..{self.num_users - 1}")
        if (scores is None) == (ranks is None):
            raise ValueError("pass either scores or ranks")
        if ranks is None:
            assert scores is not None
            ranks = target_ranks(scores.detach(), target, exclude)
        elif exclude is not None:
            raise ValueError("exclude applies to scores; ranks are counted with it already")
        elif ranks.shape != target.shape or (ranks.numel() and bool(ranks.min() < 0)):
            raise ValueError(f"ranks must be (B,) = {tuple(target.shape)} and >= 0")
        self._put("rank", user, ranks.long())
        if ranks_other is not None:
            if ranks_other.shape != target.shape or (
                ranks_other.numel() and bool(ranks_other.min() < 0)
            ):
                raise ValueError(f"ranks_other must be (B,) = {tuple(target.shape)} and >= 0")
            self._put("rank_other", user, ranks_other.long())
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
        ranks, other, target, hist, gain = (
            t[seen] for t in (self.rank, self.rank_other, self.target, self.history_len, self.gain)
        )
        item_stratum, user_bucket = self._item_stratum(target), self._user_bucket(hist)
        out = summarise_ranks(
            ranks,
            self.ks,
            item_stratum=item_stratum,
            user_bucket=user_bucket,
            gain=gain if bool((gain > -math.inf).any()) else None,
        )
        if other.numel() and bool((other >= 0).all()):  # every user has both ranks
            alt = summarise_ranks(other, self.ks, item_stratum, user_bucket)
            out.update(
                {f"{k}{self.other_suffix}": v for k, v in alt.items() if k.split("/")[-1] != "n"}
            )
        return out

    @property
    def ranks_by_protocol(self) -> dict[str, Tensor]:
        """Per-user ranks (num_users,) keyed by convention, -1 where a user was not seen;
        only the conventions that ``update`` was given."""
        out = {self.protocol: self.rank}
        if bool((self.rank_other[self.rank >= 0] >= 0).all()) and bool((self.rank >= 0).any()):
            out[self.other_suffix[1:]] = self.rank_other
        return out

    def _item_stratum(self, target: Tensor) -> Tensor | None:
        if self.item_frequency is None or self.item_boundaries is None:
            return None
        return assign_item_stratum(target, self.item_frequency, self.item_boundaries)

    def _user_bucket(self, hist: Tensor) -> Tensor | None:
        if hist.numel() == 0 or bool((hist < 0).any()):
            return None  # history lengths were not given for every user
        bounds = self.user_boundaries
        return assign_user_bucket(hist, bounds if bounds is not None else history_buckets(hist))
