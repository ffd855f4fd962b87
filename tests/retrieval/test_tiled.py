"""The tiled top-k and rank count against full score matrices (float64, ties, exclusion)."""

import math

import pytest
import torch

from bft_lightning.metrics.ranking import target_ranks as full_ranks
from bft_lightning.retrieval.scores import Exclusion, Scorer
from bft_lightning.retrieval.tiled import tile_topk, tiled_target_ranks, tiled_topk


def _vectors(users=64, items=201, dim=16, seed=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(users, dim, generator=g, dtype=dtype)
    return u, torch.randn(items, dim, generator=g, dtype=dtype)


def _scorer(u, it, bias=None, scale=None):
    """Scores ``(u it[1:]^T + bias) * scale`` of the real items (row 0 of ``it`` = padding)."""
    return Scorer(u, it[1:], bias, scale)


def _full(u, it, bias=None, scale=None):
    """The full (U, N + 1) matrix as model.score computes it, padding at -inf."""
    s = u @ it.T
    if bias is not None:
        s = s + torch.cat([bias.new_zeros(1), bias])
    if scale is not None:
        s = s * scale
    s[:, 0] = -math.inf
    return s


def _mask(exclude, n):
    return torch.zeros(exclude.shape[0], n, dtype=torch.bool).scatter_(1, exclude, True)


@pytest.mark.parametrize("n, k, group", [(1000, 10, 8), (1003, 10, 8), (257, 2, 16), (90, 2, 9),
                                         (5000, 1, 64), (999, 20, 7), (40, 5, 8)])  # fmt: skip
def test_group_max_topk_equals_topk(n, k, group):
    """Same values and ids as a full top-k (tie-free), with and without a tail, when the
    best columns crowd into one group or the tail, and (40, 5, 8) the plain fallback."""
    g = torch.Generator().manual_seed(n + k)
    scores = torch.randn(9, n, generator=g, dtype=torch.float64)
    stride = n // group
    scores[0, ::stride] += 100.0  # row 0: the whole top k in group 0 (strided columns)
    scores[1, n - (n % group or 1) :] += 50.0  # row 1: the tail holds the best
    got_v, got_i = tile_topk(scores, k, group)
    want_v, want_i = scores.topk(k, dim=1)
    assert torch.equal(got_v, want_v) and torch.equal(got_i, want_i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_group_max_topk_with_ties_and_infinities(dtype):
    """Integer scores (many ties), rows of -inf, +inf and mixed: the values equal topk's,
    the ids are distinct and point at those values."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 5, (12, 700), generator=g).to(dtype)
    scores[1] = -math.inf
    scores[2, ::50] = math.inf
    scores[3, 100:] = -math.inf
    scores[4] = 7.0
    for k in (1, 3, 10):
        v, i = tile_topk(scores, k, group=8)
        assert torch.equal(v, scores.topk(k, dim=1).values)
        assert all(len(set(row.tolist())) == k for row in i)
        assert torch.equal(scores.gather(1, i), v)


@pytest.mark.parametrize("users, items, k, tile_users, tile_columns, group", [
    (37, 1000, 5, 8, 128, 4),     # several user blocks (the last partial), 8 tiles, a tail
    (9, 4099, 10, 16, 1024, 16),  # one block, 5 tiles, a partial last tile
    (20, 640, 3, 7, 64, 8),       # tiles of exactly one group row each
    (5, 300, 5, 4, 4096, 16),     # one tile, 18 groups < 4k = 20: the plain path
])  # fmt: skip
def test_tiled_topk_equals_full_topk(users, items, k, tile_users, tile_columns, group):
    """Values, ids and log-sum-exp of the whole product (float64, tie-free), including
    users whose best columns crowd into one group or sit in the last tile."""
    u, it = _vectors(users, items + 1, 6, users + items, torch.float64)
    it[1 : 1 + group] += 30.0 * u[0]
    it[-k:] += 30.0 * u[1]
    full = _full(u, it)
    v, cols, lse = tiled_topk(_scorer(u, it), k, None, tile_users, tile_columns, group)
    want_v, want_i = full.topk(k, dim=1)
    assert torch.equal(cols + 1, want_i)
    torch.testing.assert_close(v, want_v, rtol=0, atol=1e-12)  # float64 GEMMs differ in bits
    torch.testing.assert_close(lse.double(), torch.logsumexp(full, 1), rtol=1e-6, atol=1e-6)


def test_tiled_topk_with_ties_exclusion_bias_and_scale():
    """Integer vectors tie everywhere; exclusion lists with duplicates and padding; a
    per-item bias and a per-user factor: the values equal the masked full top-k, the
    ids are distinct, eligible and point at them."""
    g = torch.Generator().manual_seed(2)
    u = torch.randint(-2, 3, (11, 4), generator=g).float()
    it = torch.randint(-2, 3, (2001, 4), generator=g).float()
    bias = torch.randint(-1, 2, (2000,), generator=g).float()
    scale = torch.tensor([0.5, 2.0, 4.0, 1.0] * 3)[:11, None]
    exclude = torch.randint(0, 2001, (11, 40), generator=g)
    exclude[:, :5] = exclude[:, 5:10]  # duplicates
    exclude[:, -3:] = 0  # padding
    for b, s in ((None, None), (bias, scale)):
        full = _full(u, it, b, s).masked_fill(_mask(exclude, 2001), -math.inf)
        v, cols, lse = tiled_topk(_scorer(u, it, b, s), 7, exclude, 4, 256, 8)
        assert torch.equal(v, full.topk(7, dim=1).values)
        assert torch.equal(full.gather(1, cols + 1), v)
        assert all(len(set(r.tolist())) == 7 for r in cols)
        torch.testing.assert_close(lse, torch.logsumexp(full, 1), rtol=1e-6, atol=1e-5)


def test_tiled_topk_with_fewer_eligible_items_than_k():
    u, it = _vectors(users=3, items=6)
    exclude = torch.tensor([[1, 2, 0], [0, 0, 0], [1, 2, 3]])
    v, cols, _ = tiled_topk(_scorer(u, it), 4, exclude)
    assert v.shape == (3, 4)
    assert (v[2, 2:] == -math.inf).all() and (v[0, :3] > -math.inf).all()
    assert (v[1] > -math.inf).all()


@pytest.mark.parametrize("tile_users, tile_columns", [(8, 64), (512, 4096), (3, 7)])
@pytest.mark.parametrize("excluded", [False, True])
def test_tiled_ranks_equal_full_ranks_on_exact_scores(tile_users, tile_columns, excluded):
    """Integer-valued vectors: every score exact in any order, ties everywhere. The tiled
    ranks equal the full matrix's, with targets in the first, a middle and the last
    tile, a padding row that would outscore every target, and exclusion lists holding
    the target, duplicates and padding."""
    g = torch.Generator().manual_seed(tile_columns)
    u = torch.randint(-3, 4, (41, 5), generator=g).float()
    it = torch.randint(-3, 4, (300, 5), generator=g).float()
    it[0] = 50.0
    target = torch.randint(1, 300, (41,), generator=g)
    target[:3] = torch.tensor([1, 150, 299])
    exclude = mask = None
    if excluded:
        exclude = torch.randint(0, 300, (41, 25), generator=g)
        exclude[:10, 0] = target[:10]  # the target excluded: still ranked by its score
        exclude[:, 1] = exclude[:, 2]  # duplicates
        mask = _mask(exclude, 300)
    want = full_ranks(_full(u, it), target, mask)
    got = tiled_target_ranks(_scorer(u, it), target, exclude, tile_users, tile_columns)
    assert torch.equal(got, want)


def test_tiled_ranks_on_random_scores_with_bias_and_scale():
    u, it = _vectors(users=70, items=5000, dim=16, seed=9)
    g = torch.Generator().manual_seed(1)
    target = torch.randint(1, 5000, (70,), generator=g)
    bias, scale = torch.randn(4999, generator=g), torch.rand(70, 1, generator=g) + 0.5
    exclude = torch.randint(0, 5000, (70, 50), generator=g)
    for b, s in ((None, None), (bias, scale)):
        for ex in (None, exclude):
            mask = None if ex is None else _mask(ex, 5000)
            want = full_ranks(_full(u, it, b, s), target, mask)
            got = tiled_target_ranks(_scorer(u, it, b, s), target, ex, tile_columns=512)
            assert torch.equal(got, want)


def test_tiled_ranks_count_equal_scores_against_the_target():
    """Scores equal in the products count against the target (pessimistic ties): a
    duplicate of a target item, and items all alike in float32, bfloat16 and float16
    (float16 holds integers only to 2048: a row of 4,999 ties is summed wider)."""
    g = torch.Generator().manual_seed(0)
    u, it = torch.randn(1000, 64, generator=g), torch.randn(5001, 64, generator=g)
    it[5000] = it[7]
    target = torch.full((1000,), 7)
    target[::2] = torch.randint(1, 5000, (500,), generator=g)
    got = tiled_target_ranks(_scorer(u, it), target, tile_columns=1024)
    assert torch.equal(got, full_ranks(_full(u, it), target))
    assert (got[1::2] >= 1).all()
    same = torch.randn(1, 64, generator=g).expand(300, 64).contiguous()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        r = tiled_target_ranks(
            _scorer(u[:50].to(dtype), same.to(dtype)), torch.randint(1, 300, (50,))
        )
        assert (r == 298).all(), dtype
    many = same[:1].expand(5000, 64).contiguous().half()
    r = tiled_target_ranks(_scorer(u[:20].half(), many), torch.randint(1, 5000, (20,)))
    assert (r == 4998).all()


def test_no_users_and_the_tile_bounds():
    u, it = torch.randn(0, 4), torch.randn(10, 4)
    r = tiled_target_ranks(_scorer(u, it), torch.zeros(0, dtype=torch.long))
    assert r.shape == (0,) and r.dtype == torch.long
    v, cols, lse = tiled_topk(_scorer(u, it), 3)
    assert v.shape == cols.shape == (0, 3) and lse.shape == (0,)
    users, target = torch.randn(3, 4), torch.tensor([1, 5, 9])
    want = full_ranks(_full(users, it), target)
    assert torch.equal(tiled_target_ranks(_scorer(users, it), target, tile_columns=2**24), want)
    with pytest.raises(ValueError, match="2\\^24"):
        tiled_target_ranks(_scorer(users, it), target, tile_columns=2**24 + 1)
    with pytest.raises(ValueError, match="tile_users"):
        tiled_topk(_scorer(users, it), 3, group=0)


def test_exclusion_masks_only_its_tile_columns():
    exclude = torch.tensor([[3, 0, 3, 10], [1, 2, 0, 0]])  # ids; columns = id - 1
    ex = Exclusion(exclude)
    tile = torch.zeros(2, 4)
    ex.mask(tile, 0)  # columns 0..3: ids 1..4
    assert tile.isinf().nonzero().tolist() == [[0, 2], [1, 0], [1, 1]]
    tile = torch.zeros(2, 4)
    ex.mask(tile, 8)  # columns 8..11: id 10 -> column 1 of the tile
    assert tile.isinf().nonzero().tolist() == [[0, 1]]


def test_tiled_topk_when_every_tile_beats_the_running_top_k():
    """Scores rising with the column for some users (every tile's groups beat the running
    k-th best: the prefilter path each tile), falling for others (no group after the
    first tile does) and random for the rest (a few groups gathered per tile)."""
    g = torch.Generator().manual_seed(4)
    n = 3000
    it = torch.randn(n + 1, 3, generator=g, dtype=torch.float64)
    it[:, 0] = torch.arange(n + 1, dtype=torch.float64)
    u = torch.randn(30, 3, generator=g, dtype=torch.float64)
    u[:10, 0], u[10:20, 0] = 1.0, -1.0
    full = _full(u, it)
    for k in (1, 10, 30):
        v, cols, _ = tiled_topk(_scorer(u, it), k, None, 16, 256, 8)
        want_v, want_i = full.topk(k, dim=1)
        assert torch.equal(cols + 1, want_i)
        torch.testing.assert_close(v, want_v, rtol=0, atol=1e-12)
