"""Score tiles of ``model.score`` and the per-user exclusion applied inside them.

``Scorer`` holds what ``SequentialRecommender.score`` multiplies: the users'
transformed states ``u`` (U, d), the real items' output embeddings ``V``
(N, d: row j is item j + 1), an optional per-item bias ``b`` (N,) and an
optional positive per-user factor ``s`` (U, 1) (``head="precision"``). A tile
of columns ``[j, j + w)`` is computed in the order ``model.score`` computes
the full matrix: ``(u V^T + b) * s``, element by element after one product,
so a tile's entries are the full matrix's wherever the GEMMs agree (always
for exact arithmetic; tests compare them with random vectors too).

``Exclusion`` keeps each user's excluded items as a list of (row, column)
pairs sorted by column, so a tile sets its own excluded entries to -inf with
one indexed write and no (users x items) mask exists anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender


@dataclass(frozen=True)
class Scorer:
    """The factors of ``model.score`` for one batch of users (see the module docstring)."""

    users: Tensor  # (U, d) output_transform(hidden), in the weights' dtype
    items: Tensor  # (N, d) real items; row j = item j + 1
    bias: Tensor | None  # (N,) or None
    scale: Tensor | None  # (U, 1) positive, or None

    @staticmethod
    @torch.no_grad()
    def of(model: SequentialRecommender, hidden: Tensor, log_prec: Tensor | None) -> Scorer:
        """The factors as ``model.score(hidden.to(weights), log_prec)`` uses them, with
        autocast off: evaluation scores in the weights' dtype (a bf16 score matrix
        under mixed precision ties many items with the target)."""
        weights = model.item_weights()  # (N + 1, d)
        if hidden.ndim != 2 or hidden.shape[1] != weights.shape[1]:
            raise ValueError(f"hidden must be (N, {weights.shape[1]}), got {tuple(hidden.shape)}")
        with torch.autocast(hidden.device.type, enabled=False):
            h = model.output_transform(hidden.to(weights.dtype))
            bias = model.item_bias()  # (N + 1,) or None
            b = None if bias is None else bias[1 : weights.shape[0]].to(h.dtype)
            scale = model.output_scale(log_prec)  # (U, 1) or None, as model.score uses it
            s = None if scale is None else scale.to(h.dtype)
        return Scorer(h.detach(), weights[1:].detach(), b, None if s is None else s.detach())

    @property
    def num_items(self) -> int:
        return self.items.shape[0]

    def rows(self, index: Tensor | slice) -> Scorer:
        """The same items for a subset of the users."""
        s = None if self.scale is None else self.scale[index]
        return Scorer(self.users[index], self.items, self.bias, s)

    def tile(self, j: int, w: int, out: Tensor) -> Tensor:
        """Scores of items ``j + 1 .. j + w`` for every user, written into ``out`` (U, w)."""
        torch.mm(self.users, self.items[j : j + w].T, out=out)
        if self.bias is not None:
            out.add_(self.bias[j : j + w])
        if self.scale is not None:
            out.mul_(self.scale)
        return out

    def columns(self, cols: Tensor) -> Tensor:
        """Scores (U, m) of the items in columns ``cols`` (m,) (item ``cols + 1``), in the
        order ``tile`` computes them: ``(u V^T + b) * s`` after one product."""
        out = torch.mm(self.users, self.items[cols].T)
        if self.bias is not None:
            out.add_(self.bias[cols])
        if self.scale is not None:
            out.mul_(self.scale)
        return out

    def dense(self) -> Tensor:
        """All scores (U, N + 1), column 0 (padding) at -inf: the dense fallback's matrix."""
        out = self.users.new_empty(self.users.shape[0], self.num_items + 1)
        out[:, 0] = float("-inf")
        self.tile(0, self.num_items, out[:, 1:])
        return out

    def finite_and_bounded(self) -> bool:
        """Whether every score is finite for certain: finite factors whose product cannot
        overflow the dtype (``|s| <= (max|u| max|v| d + max|b|) max s``). Otherwise the
        dense path runs, which refuses NaN scores as the full score matrix did."""
        if self.users.numel() == 0 or self.items.numel() == 0:
            return True
        bound = _max_abs(self.users) * _max_abs(self.items) * self.users.shape[1]
        if self.bias is not None and self.bias.numel():
            bound += _max_abs(self.bias)
        if self.scale is not None and self.scale.numel():
            bound *= float(self.scale.amax())
        return bound < torch.finfo(self.users.dtype).max  # False for NaN and inf


def _max_abs(x: Tensor) -> float:
    """max |x| in one pass without a temporary (``x.abs().amax()`` writes a copy of
    ``x``, slower: results/perf/notes.md); NaN if ``x`` holds one."""
    low, high = torch.aminmax(x)
    return max(-float(low), float(high)) if not torch.isnan(low) else float("nan")


def check_exclude(exclude: Tensor | None, users: int, num_items: int) -> None:
    if exclude is None:
        return
    if exclude.ndim != 2 or exclude.shape[0] != users:
        raise ValueError(
            f"exclude must be (N, L) item ids with N = {users} users, got {tuple(exclude.shape)}"
        )
    if exclude.dtype.is_floating_point or exclude.dtype == torch.bool:
        raise ValueError(f"exclude must hold integer item ids, got {exclude.dtype}")
    if exclude.numel() and (exclude.min() < 0 or exclude.max() > num_items):
        raise ValueError(f"exclude ids must be in 0..{num_items} (0 is padding, ignored)")


class Exclusion:
    """Excluded (row, column) pairs of a block of users, sorted by column.

    ``exclude`` (c, L) holds item ids, 0 = padding (ignored); column = id - 1.
    A user's repeated item is kept once, so each excluded entry is counted once.
    """

    def __init__(self, exclude: Tensor) -> None:
        rows, pos = (exclude > 0).nonzero(as_tuple=True)
        cols = exclude[rows, pos].long() - 1
        c = max(exclude.shape[0], 1)
        key = torch.unique(cols * c + rows)  # sorted by column, then row; duplicates once
        self.rows, self.cols = key % c, key.div(c, rounding_mode="floor")

    def _span(self, j: int, w: int) -> tuple[int, int]:
        bounds = torch.tensor([j, j + w], device=self.cols.device)
        lo, hi = torch.searchsorted(self.cols, bounds).tolist()
        return lo, hi

    def mask(self, tile: Tensor, j: int) -> Tensor:
        """Set the excluded entries of ``tile`` (c, w), columns ``j .. j + w - 1``, to -inf."""
        lo, hi = self._span(j, tile.shape[1])
        if hi > lo:
            tile[self.rows[lo:hi], self.cols[lo:hi] - j] = float("-inf")
        return tile

    def count_at_or_above(self, tile: Tensor, j: int, t_score: Tensor, col: Tensor) -> Tensor:
        """(c,) per row: excluded entries of ``tile`` (c, w; columns ``j ..``) scoring at
        least ``t_score`` (c, 1), other than the row's target column ``col`` (c,).

        Subtracted from the unmasked count, it gives the rank with these items excluded
        from the same scores, so both conventions come from one pass over the tiles."""
        counts = torch.zeros(tile.shape[0], dtype=torch.long, device=tile.device)
        lo, hi = self._span(j, tile.shape[1])
        if hi > lo:
            r, c = self.rows[lo:hi], self.cols[lo:hi]
            above = (tile[r, c - j] >= t_score[r, 0]) & (c != col[r])
            counts.index_add_(0, r[above], torch.ones_like(r[above]))
        return counts
