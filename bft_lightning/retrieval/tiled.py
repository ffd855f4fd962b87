"""The tiled paths: a top-k and the targets' full ranks, one cache-sized score tile at a time.

A score matrix of ``users x items`` written to main memory and read back
costs more than its product (a fresh ``chunk x N`` output per chunk also page
faults; timings in ``results/perf/notes.md``). So scores are made a tile
(``TILE_USERS x TILE_COLUMNS``) at a time into one reused buffer and reduced
at once; the excluded entries of each tile are set to -inf first
(:class:`~bft_lightning.retrieval.scores.Exclusion`).

Top-k: a tile's columns are cut into ``stride`` groups of ``TILE_GROUP``
columns (group r holds columns ``r, r + stride, ...``, so a group maximum is
an elementwise max over the rows of the tile's (group, stride) view, which
vectorises). Only groups whose maximum beats the running k-th best score can
change the top k; they are gathered from the tile itself (so the values
returned are the tile's scores) and merged with the running top k. Where
many groups beat it (the first tiles), the k groups with the largest maxima
are taken instead: they hold the tile's top k (a group outside them has k
group maxima at or above its own). The log-sum-exp is accumulated tile by
tile from the same scores.

Ranks: every score, the target's included, comes from the same tile GEMMs, so
scores equal there count against the target (pessimistic ties) as in
:func:`bft_lightning.metrics.ranking.target_ranks` on the full matrix.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bft_lightning.retrieval.scores import Exclusion, Scorer

TILE_USERS = 512  # users per score tile
TILE_COLUMNS = 4096  # columns per score tile (8 MB in float32 with 512 users)
TARGET_TILES = 2  # a block whose targets span more tiles takes its target scores in one product
TILE_GROUP = 8  # columns per group of the top-k prefilter
LOG2E = 1.0 / math.log(2.0)


def _blocks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _exclusion(exclude: Tensor | None, rows: Tensor | slice) -> Exclusion | None:
    return None if exclude is None else Exclusion(exclude[rows])


def tile_candidates(
    tile: Tensor, k: int, threshold: Tensor, group: int = TILE_GROUP
) -> tuple[Tensor, Tensor, Tensor]:
    """Entries of ``tile`` (c, w) that can enter a running top k, and each row's maximum.

    ``threshold`` (c, 1) is the running k-th best score (-inf while fewer are known):
    an entry at or below it cannot change the top k's values. Returns candidate
    values and their columns (c, m), a superset of the tile's entries above the
    threshold among its top k, and the row maxima (c,). Groups whose maximum is
    above the threshold are gathered; where more than ``2k`` are (the first tiles)
    the k groups with the largest maxima are, which hold the tile's top k. The
    columns after the last whole group are always candidates.
    """
    c, w = tile.shape
    stride = w // group
    if stride < 4 * k:  # too few groups for the prefilter to pay
        v, cols = tile.topk(min(k, w), dim=1)
        return v, cols, tile.amax(1)
    covered = stride * group
    maxima = tile[:, :covered].unflatten(1, (group, stride)).amax(1)  # (c, stride)
    row_max = maxima.amax(1)
    offsets = torch.arange(group, device=tile.device) * stride  # group g: g + m stride
    hit = maxima > threshold  # (c, stride)
    counts = hit.sum(1)
    most = int(counts.max()) if c else 0
    if most > 2 * k:
        best = maxima.topk(k, dim=1).indices  # (c, k) groups
        cols = (best.unsqueeze(-1) + offsets).flatten(1)  # (c, k group)
        v = tile.gather(1, cols)
    else:  # few groups above the threshold: just those, padded with -inf per row
        some = (counts > 0).nonzero().squeeze(1)  # in later tiles few rows have a hit
        sub, grp = hit[some].nonzero(as_tuple=True)  # row-major: each row's groups in a run
        row = some[sub]
        pos = torch.arange(row.numel(), device=tile.device) - (counts.cumsum(0) - counts)[row]
        gcols = grp.unsqueeze(1) + offsets  # (P, group)
        v = tile.new_full((c, most, group), float("-inf"))
        cols = torch.zeros(c, most, group, dtype=torch.long, device=tile.device)
        v[row, pos] = tile[row.unsqueeze(1), gcols]
        cols[row, pos] = gcols
        v, cols = v.flatten(1), cols.flatten(1)
    if covered < w:
        tail = tile[:, covered:]
        row_max = torch.maximum(row_max, tail.amax(1))
        v = torch.cat([v, tail], 1)
        cols = torch.cat([cols, torch.arange(covered, w, device=tile.device).expand(c, -1)], 1)
    return v, cols, row_max


def tile_topk(tile: Tensor, k: int, group: int = TILE_GROUP) -> tuple[Tensor, Tensor]:
    """``tile.topk(min(k, w), dim=1)`` (values, column ids) through strided group maxima:
    equal to ``topk`` except in which of equally scored columns is returned."""
    threshold = tile.new_full((tile.shape[0], 1), float("-inf"))
    v, cols, _ = tile_candidates(tile, k, threshold, group)
    v, pos = v.topk(min(k, tile.shape[1]), dim=1)
    return v, cols.gather(1, pos)


def _tile_logsumexp(tile: Tensor, row_max: Tensor, scratch: Tensor) -> Tensor:
    """(c,) log-sum-exp of each row of ``tile`` (c, w) given its maxima (c,), -inf for a
    row of -inf: ``exp2`` of ``x log2 e - max log2 e`` (one pass into a reused float32
    buffer, then ``exp2`` in place, faster than ``exp``: results/perf/notes.md), then a
    row sum."""
    m = row_max.float().unsqueeze(1)  # (c, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.add(m * -LOG2E, tile, alpha=LOG2E, out=scratch[: tile.shape[0], : tile.shape[1]])
    total = torch.exp2(s, out=s).sum(1)
    return m.squeeze(1) + total.log()


@torch.no_grad()
def tiled_topk(
    scorer: Scorer,
    k: int,
    exclude: Tensor | None = None,
    tile_users: int = TILE_USERS,
    tile_columns: int = TILE_COLUMNS,
    group: int = TILE_GROUP,
) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k (U, min(k, N)) scores and 0-based columns, best first, and the log-sum-exp (U,).

    Excluded entries are -inf (so are their places in the top-k when fewer
    items are eligible). Scores are in the scorer's dtype, the log-sum-exp float32.
    """
    if min(tile_users, tile_columns, group) < 1:
        raise ValueError("tile_users, tile_columns and group must be >= 1")
    n, dev = scorer.num_items, scorer.users.device
    kk = min(k, n)
    width = max(group, tile_columns // group * group)  # whole groups per full tile
    buf = scorer.users.new_empty(min(tile_users, scorer.users.shape[0]), min(width, n))
    scratch = torch.empty(buf.shape, dtype=torch.float32, device=dev)
    vals, ids, lses = [], [], []
    for rows in _blocks(scorer.users.shape[0], tile_users):
        block, excl = scorer.rows(rows), _exclusion(exclude, rows)
        c = rows.stop - rows.start
        best_v = buf.new_full((c, kk), float("-inf"))
        best_i = torch.zeros(c, kk, dtype=torch.long, device=dev)
        lse = torch.full((c,), float("-inf"), device=dev)
        for j in range(0, n, width):
            w = min(width, n - j)
            tile = block.tile(j, w, buf[:c, :w])
            if excl is not None:
                excl.mask(tile, j)
            v, i, row_max = tile_candidates(tile, kk, best_v[:, -1:], group)
            lse = torch.logaddexp(lse, _tile_logsumexp(tile, row_max, scratch))
            if v.shape[1] == 0:
                continue
            v, pos = torch.cat([best_v, v], 1).topk(kk, dim=1)
            best_i = torch.cat([best_i, i + j], 1).gather(1, pos)
            best_v = v
        vals.append(best_v)
        ids.append(best_i)
        lses.append(lse)
    if not vals:
        empty = scorer.users.new_empty(0, kk)
        return empty, empty.long(), empty.new_empty(0, dtype=torch.float32)
    return torch.cat(vals), torch.cat(ids), torch.cat(lses)


@torch.no_grad()
def tiled_target_ranks(
    scorer: Scorer,
    target: Tensor,
    exclude: Tensor | None = None,
    tile_users: int = TILE_USERS,
    tile_columns: int = TILE_COLUMNS,
) -> Tensor:
    """Pessimistic 0-based ranks (U,) of ``target`` (U,) item ids (see :func:`tiled_ranks`)."""
    return tiled_ranks(scorer, target, exclude, tile_users, tile_columns)[0]


@torch.no_grad()
def tiled_ranks(
    scorer: Scorer,
    target: Tensor,
    exclude: Tensor | None = None,
    tile_users: int = TILE_USERS,
    tile_columns: int = TILE_COLUMNS,
    seen: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Pessimistic 0-based ranks (U,) of ``target`` (U,) item ids, a score tile at a time.

    ``rank_u = #{j >= 1, j != t_u, j not excluded : s_uj >= s_ut}``: a target that
    is itself excluded keeps its score and is still ranked (as on the full matrix).
    The users are sorted by target, so a block of users has its targets in few
    tiles (one or two where users outnumber items): those tiles are computed first
    for the target scores (the same call on the same buffer as in the counting
    pass, hence the same values), then every tile, its excluded entries at -inf,
    adds its count of scores at or above them (the last target tile, still in the
    buffer, without a second product), and the target's own entry is taken out in
    the tile that holds it.

    With ``seen`` (U, L) item ids (0 = padding), the ranks with those items also
    excluded come from the same tiles: each tile's seen entries at or above the
    target (the target itself never) are counted before the tile is compared, and
    returned second (None without ``seen``). Both conventions thus see the same
    score values, and the second equals a run with ``exclude=seen``.
    """
    if min(tile_users, tile_columns) < 1 or tile_columns > 2**24:
        raise ValueError("tile_users must be >= 1 and tile_columns in 1..2^24 (exact counts)")
    n, dev = scorer.num_items, scorer.users.device
    ranks = torch.empty(target.shape[0], dtype=torch.long, device=dev)
    masked = torch.empty_like(ranks) if seen is not None else None
    if target.numel() == 0:
        return ranks, masked
    order = torch.argsort(target, stable=True)  # users by target: few target tiles a block
    tgt = target[order].long() - 1  # (U,) column of each sorted user's target
    sorted_scorer = scorer.rows(order)
    sorted_exclude = None if exclude is None else exclude[order]
    sorted_seen = None if seen is None else seen[order]
    buf = scorer.users.new_empty((min(tile_users, target.shape[0]), min(tile_columns, n)))
    wide = torch.promote_types(buf.dtype, torch.float32)  # exact counts in the row sums

    def count_into(
        tile: Tensor,
        j: int,
        t_score: Tensor,
        col: Tensor,
        counts: Tensor,
        excl: Exclusion | None,
        seen_at: Exclusion | None,
    ) -> None:
        # the tile becomes its own 0/1 indicator of "at or above the target" in place,
        # and a float row sum counts it (cheaper than a bool tensor and an integer
        # sum: results/perf/notes.md); exact: a row holds at most 2^24 ones, summed in
        # float32 at least.
        # counts (3, c): the count at or above the target, the target's own (0 / 1) and
        # the seen items' among them
        if excl is not None:
            excl.mask(tile, j)
        if seen_at is not None:  # before the tile becomes its indicator
            counts[2] += seen_at.count_at_or_above(tile, j, t_score, col)
        above = tile.ge_(t_score)
        counts[0] += above.sum(1, dtype=wide).long()
        rows = ((col >= j) & (col < j + above.shape[1])).nonzero().squeeze(1)
        if rows.numel():  # the target itself (0 if it is excluded)
            counts[1, rows] = above[rows, col[rows] - j].long()

    for rows in _blocks(target.shape[0], tile_users):
        block, col, idx = sorted_scorer.rows(rows), tgt[rows], order[rows]
        excl = _exclusion(sorted_exclude, rows)
        seen_at = _exclusion(sorted_seen, rows)
        c = col.shape[0]
        t_score = buf.new_empty(c, 1)
        counts = torch.zeros(3, c, dtype=torch.long, device=dev)
        target_tiles = (
            col.div(tile_columns, rounding_mode="floor").unique() * tile_columns
        ).tolist()
        counted = -1  # the tile already counted (the last target tile, still in the buffer)
        if len(target_tiles) <= TARGET_TILES:
            for j in target_tiles:
                w = min(tile_columns, n - j)
                tile = block.tile(j, w, buf[:c, :w])
                hit = ((col >= j) & (col < j + w)).nonzero().squeeze(1)
                t_score[hit, 0] = tile[hit, col[hit] - j]  # before exclusion: its own score
            count_into(tile, target_tiles[-1], t_score, col, counts, excl, seen_at)
            counted = target_tiles[-1]
        else:
            # targets spread over many tiles (more tiles than users in a block, as with
            # a million items): a tile each would double the products, so the target
            # scores come from one product with the block's target columns alone
            cols, where = col.unique(return_inverse=True)  # (m,), (c,)
            t_score.copy_(block.columns(cols).gather(1, where.unsqueeze(1)))
        for j in range(0, n, tile_columns):
            if j != counted:
                w = min(tile_columns, n - j)
                tile = block.tile(j, w, buf[:c, :w])
                count_into(tile, j, t_score, col, counts, excl, seen_at)
        ranks[idx] = counts[0] - counts[1]
        if masked is not None:
            masked[idx] = counts[0] - counts[1] - counts[2]
    return ranks, masked
