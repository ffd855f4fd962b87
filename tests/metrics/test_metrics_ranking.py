"""Ranks and per-user HR/NDCG/MRR against brute force and torchmetrics; faiss vs torch top-k."""

import math

import pytest
import torch
from torchmetrics.functional.retrieval import (
    retrieval_hit_rate,
    retrieval_normalized_dcg,
    retrieval_reciprocal_rank,
)

import bft_lightning.metrics.ranking as ranking
from bft_lightning.metrics.ranking import (
    chunked_target_ranks,
    faiss_topk,
    hr_ndcg_mrr,
    ranks_from_topk,
    target_ranks,
    tiled_target_ranks,
    topk_metrics,
    topk_rows,
    torch_topk_chunked,
    torch_topk_tiled,
)

KS = (1, 5, 10, 20)


def brute_rank(scores, target, exclude=None):
    """Python loop: other real, non-excluded items scoring >= the target."""
    out = []
    for b in range(scores.shape[0]):
        t = int(target[b])
        r = 0
        for j in range(1, scores.shape[1]):
            if j == t or (exclude is not None and exclude[b, j]):
                continue
            r += int(scores[b, j] >= scores[b, t])
        out.append(r)
    return out


@pytest.mark.parametrize("with_exclude", [False, True])
def test_target_ranks_match_brute_force_with_ties(with_exclude):
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (12, 25), generator=g).float()  # many ties
    target = torch.randint(1, 25, (12,), generator=g)
    exclude = torch.rand(12, 25, generator=g) < 0.3 if with_exclude else None
    if exclude is not None:
        exclude[:3].scatter_(1, target[:3, None], True)  # target in the history: still ranked
    assert target_ranks(scores, target, exclude).tolist() == brute_rank(scores, target, exclude)


@pytest.mark.parametrize("block", [1, 3, 7, 4096])
def test_blocked_rank_count_matches_brute_force(monkeypatch, block):
    """The column-blocked count (no exclusion) at block sizes that cut rows anywhere,
    with ties, a padding column that would count and infinite scores."""
    monkeypatch.setattr(ranking, "RANK_BLOCK", block)
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (16, 23), generator=g).float()
    scores[::3, 0] = 10.0  # padding above every target: must not count
    scores[1, 5] = -math.inf
    scores[2, :] = math.inf
    target = torch.randint(1, 23, (16,), generator=g)
    target[1] = 5  # a target at -inf: every other real item counts
    assert target_ranks(scores, target).tolist() == brute_rank(scores, target)


@pytest.mark.parametrize("n, k, group", [(1000, 10, 8), (1003, 10, 8), (257, 2, 16), (90, 2, 9),
                                         (5000, 1, 64), (999, 20, 7), (40, 5, 8)])  # fmt: skip
def test_group_max_topk_equals_topk(n, k, group):
    """Same values and ids as a full top-k (tie-free scores), with and without a tail,
    when the best columns crowd into one group or the tail, and (40, 5, 8: fewer than
    4k groups) through the plain top-k fallback."""
    g = torch.Generator().manual_seed(n + k)
    scores = torch.randn(9, n, generator=g, dtype=torch.float64)
    scores[0, :group] += 100.0  # row 0: the whole top k in the first group (if k <= group)
    scores[1, n - (n % group or 1) :] += 50.0  # row 1: the tail holds the best
    got_v, got_i = topk_rows(scores, k, group)
    want_v, want_i = scores.topk(k, dim=1)
    assert torch.equal(got_v, want_v) and torch.equal(got_i, want_i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_group_max_topk_with_ties_and_infinities(dtype):
    """Integer scores (many ties), rows of -inf, +inf and mixed: the values equal topk's,
    the ids are distinct and point at those values (which of tied columns may differ)."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 5, (12, 700), generator=g).to(dtype)
    scores[1] = -math.inf
    scores[2, ::50] = math.inf
    scores[3, 100:] = -math.inf
    scores[4] = 7.0  # one value everywhere
    for k in (1, 3, 10):
        v, i = topk_rows(scores, k, group=8)
        assert torch.equal(v, scores.topk(k, dim=1).values)
        assert all(len(set(row.tolist())) == k for row in i)
        assert torch.equal(scores.gather(1, i), v)
    with pytest.raises(ValueError, match="group"):
        topk_rows(scores, 3, group=0)


def test_torch_topk_through_the_prefilter_equals_faiss():
    """Enough items (N >= 4 k x 64) that torch_topk_chunked takes the group-max path."""
    u, it = _vectors(users=40, items=3001, dim=16, seed=6)
    f_scores, f_ids = faiss_topk(u, it, 5)
    t_scores, t_ids = torch_topk_chunked(u, it, 5, chunk=16)
    assert torch.equal(f_ids, t_ids)
    assert torch.allclose(f_scores, t_scores, atol=1e-5)


def test_exclusion_only_lowers_ranks():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(16, 40, generator=g)
    target = torch.randint(1, 40, (16,), generator=g)
    exclude = torch.rand(16, 40, generator=g) < 0.5
    assert (target_ranks(scores, target, exclude) <= target_ranks(scores, target)).all()


def test_all_equal_scores_are_pessimistic():
    scores = torch.zeros(5, 31)
    target = torch.tensor([1, 2, 10, 29, 30])
    ranks = target_ranks(scores, target)
    assert ranks.tolist() == [29] * 5  # N - 2: every other real item counts above
    per_user = hr_ndcg_mrr(ranks, KS)
    for k in KS:
        assert per_user[f"hr@{k}"].sum() == 0 and per_user[f"ndcg@{k}"].sum() == 0


def test_padding_column_never_counts():
    scores = torch.tensor([[100.0, 1.0, 2.0, 3.0], [float("inf"), 3.0, 2.0, 1.0]])
    assert target_ranks(scores, torch.tensor([3, 1])).tolist() == [0, 0]
    # a target scored -inf ties with nothing but real items; padding still not counted
    scores = torch.tensor([[-math.inf, -math.inf, 0.0, -math.inf]])
    assert target_ranks(scores, torch.tensor([1])).tolist() == [2]


def test_invalid_inputs_raise():
    scores = torch.randn(2, 5)
    with pytest.raises(ValueError, match="NaN"):
        target_ranks(torch.tensor([[0.0, float("nan"), 1.0]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="padding"):
        target_ranks(scores, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="padding"):
        target_ranks(scores, torch.tensor([5, 1]))


def test_formulas_against_brute_force():
    ranks = torch.tensor([0, 1, 4, 5, 9, 10, 19, 20, 500])
    per_user = hr_ndcg_mrr(ranks, KS)
    for i, r in enumerate(ranks.tolist()):
        for k in KS:
            assert per_user[f"hr@{k}"][i] == float(r < k)
            expect = 1.0 / math.log2(r + 2) if r < k else 0.0
            assert per_user[f"ndcg@{k}"][i].item() == pytest.approx(expect, abs=1e-15)
        assert per_user["mrr"][i].item() == pytest.approx(1.0 / (r + 1), abs=1e-15)


def test_against_torchmetrics_on_positive_scores():
    """torchmetrics drops scores <= 0 and averages 2D NDCG: compare 1D, positive, tie-free."""
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(16, 60, generator=g) + 0.01  # (B, N), positive
    target = torch.randint(1, 60, (16,), generator=g)
    per_user = hr_ndcg_mrr(target_ranks(scores, target), KS)
    for b in range(16):
        preds = scores[b, 1:]  # real items only
        rel = torch.zeros_like(preds, dtype=torch.bool)
        rel[target[b] - 1] = True
        for k in KS:
            assert per_user[f"hr@{k}"][b].item() == retrieval_hit_rate(preds, rel, top_k=k)
            tm = retrieval_normalized_dcg(preds, rel, top_k=k).item()
            assert per_user[f"ndcg@{k}"][b].item() == pytest.approx(tm, abs=1e-6)
        tm_rr = retrieval_reciprocal_rank(preds, rel).item()
        assert per_user["mrr"][b].item() == pytest.approx(tm_rr, abs=1e-6)


def _vectors(users=64, items=201, dim=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(users, dim, generator=g), torch.randn(items, dim, generator=g)


def test_faiss_equals_torch_topk_and_full_ranking():
    u, it = _vectors()
    k = 20
    f_scores, f_ids = faiss_topk(u, it, k)
    t_scores, t_ids = torch_topk_chunked(u, it, k, chunk=17)
    assert torch.equal(f_ids, t_ids)
    assert torch.allclose(f_scores, t_scores, atol=1e-5)
    assert (f_ids > 0).all()  # padding never retrieved
    # targets at mixed true ranks, some outside the top-k
    full = u @ it.T  # (U, N)
    full[:, 0] = -math.inf
    order = full.argsort(1, descending=True)
    pick = torch.arange(64) % 30
    target = order[torch.arange(64), pick]
    truth = hr_ndcg_mrr(target_ranks(u @ it.T, target), KS)
    got = topk_metrics(f_ids, target, KS)
    assert set(got) == {f"{m}@{k}" for m in ("hr", "ndcg") for k in KS}
    for key, value in got.items():
        assert torch.allclose(value, truth[key]), key
    assert ranks_from_topk(f_ids, target).tolist() == [min(p, k) for p in pick.tolist()]


def test_padding_can_be_included_and_k_is_checked():
    u, it = _vectors(users=4, items=6)
    it[0] = 100 * u.mean(0)  # sum_u <u, it[0]> > 0: padding wins for some user
    _, ids = faiss_topk(u, it, 3, exclude_padding=False)
    _, ids_t = torch_topk_chunked(u, it, 3, exclude_padding=False)
    assert torch.equal(ids, ids_t) and (ids[:, 0] == 0).any()
    with pytest.raises(ValueError):
        faiss_topk(u, it, 6)  # only 5 real items
    with pytest.raises(ValueError):
        topk_metrics(ids, torch.ones(4, dtype=torch.long), ks=(5,))


def test_chunked_target_ranks_equal_full():
    u, it = _vectors(users=50, items=80)
    target = torch.randint(1, 80, (50,), generator=torch.Generator().manual_seed(4))
    assert torch.equal(chunked_target_ranks(u, it, target, chunk=7), target_ranks(u @ it.T, target))


@pytest.mark.parametrize("users, items, k, tile_users, tile_columns, group", [
    (37, 1000, 5, 8, 128, 4),    # several user blocks (the last partial), 8 tiles, a tail
    (9, 4099, 10, 16, 1024, 16),  # one block, 5 tiles of 816 columns, 19 tail columns
    (20, 640, 3, 7, 64, 8),       # tiles of exactly one group row each, no tail
    (5, 300, 5, 4, 4096, 16),     # one tile, 18 groups < 4k = 20: the plain path
])  # fmt: skip
def test_tiled_topk_equals_full_topk(users, items, k, tile_users, tile_columns, group):
    """Values and ids of a top-k over the whole product (float64, tie-free), including
    rows whose best columns crowd into one group, fill the tail, or sit in the last tile."""
    g = torch.Generator().manual_seed(users + items)
    u = torch.randn(users, 6, generator=g, dtype=torch.float64)
    it = torch.randn(items + 1, 6, generator=g, dtype=torch.float64)
    it[1 : 1 + group] += 30.0 * u[0]  # user 0: the top k all in group 0 of tile 0
    it[-k:] += 30.0 * u[1]  # user 1: the best in the tail / the last tile
    full = u @ it[1:].T
    want_v, want_i = full.topk(k, dim=1)
    got_v, got_i = torch_topk_tiled(u, it, k, tile_users=tile_users, tile_columns=tile_columns,
                                    group=group)  # fmt: skip
    assert torch.equal(got_i, want_i + 1)
    assert torch.allclose(got_v, want_v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("where", ["user", "item"])
@pytest.mark.parametrize(
    "path",
    [
        faiss_topk,
        lambda u, it, k: torch_topk_chunked(u, it, k, tiled=False),
        lambda u, it, k: torch_topk_tiled(u, it, k, screen=False),
    ],
)
def test_topk_paths_refuse_nan(path, where):
    """A NaN vector makes the top-k undefined: faiss returned the padding id for such
    a user and the float paths ranked a NaN item first, so every path refuses it."""
    u, it = _vectors()
    (u if where == "user" else it)[3, 5] = math.nan
    with pytest.raises(ValueError, match=f"{where}_vecs contain NaN"):
        path(u, it, 5)


def test_tiled_topk_is_the_cpu_default_and_agrees_with_faiss_and_the_untiled_path():
    u, it = _vectors(users=300, items=20001, dim=16, seed=8)
    f_scores, f_ids = faiss_topk(u, it, 10)
    t_scores, t_ids = torch_topk_chunked(u, it, 10)  # tiled on a CPU
    c_scores, c_ids = torch_topk_chunked(u, it, 10, chunk=64, tiled=False)
    assert torch.equal(t_ids, f_ids) and torch.equal(t_ids, c_ids)
    assert torch.allclose(t_scores, f_scores, atol=1e-5) and torch.allclose(t_scores, c_scores)
    _, ids = torch_topk_tiled(u, it, 3, exclude_padding=False, tile_columns=512)
    assert torch.equal(ids, (u @ it.T).topk(3, dim=1).indices)  # padding column 0 included


def test_tiled_topk_with_ties_returns_the_tied_values():
    """Integer scores tie everywhere: the values equal topk's and the ids are distinct
    and point at them (which of tied columns may differ)."""
    g = torch.Generator().manual_seed(2)
    u = torch.randint(-2, 3, (11, 4), generator=g).float()
    it = torch.randint(-2, 3, (2001, 4), generator=g).float()
    v, i = torch_topk_tiled(u, it, 7, tile_users=4, tile_columns=256, group=8)
    full = u @ it.T
    full[:, 0] = -math.inf
    assert torch.equal(v, full.topk(7, dim=1).values)
    assert torch.equal(full.gather(1, i), v) and all(len(set(r.tolist())) == 7 for r in i)
    with pytest.raises(ValueError, match="tile_users"):
        torch_topk_tiled(u, it, 3, group=0)


@pytest.mark.parametrize("tile_users, tile_columns", [(8, 64), (512, 4096), (3, 7)])
def test_tiled_target_ranks_equal_full_ranks_on_exact_scores(tile_users, tile_columns):
    """Integer-valued vectors make every score exact in any summation order, with ties
    everywhere: the tiled ranks equal ``target_ranks`` on the full product exactly,
    with targets in the first, a middle and the last tile, and a padding row that
    would outscore every target."""
    g = torch.Generator().manual_seed(tile_columns)
    u = torch.randint(-3, 4, (41, 5), generator=g).float()
    it = torch.randint(-3, 4, (300, 5), generator=g).float()
    it[0] = 50.0  # padding: never counts
    target = torch.randint(1, 300, (41,), generator=g)
    target[:3] = torch.tensor([1, 150, 299])
    want = target_ranks(u @ it.T, target)
    assert torch.equal(tiled_target_ranks(u, it, target, tile_users, tile_columns), want)
    assert torch.equal(chunked_target_ranks(u, it, target), want)  # the CPU default


def test_tiled_target_ranks_on_random_scores_and_bad_input():
    u, it = _vectors(users=70, items=5000, dim=16, seed=9)
    u, it = u.double(), it.double()
    target = torch.randint(1, 5000, (70,), generator=torch.Generator().manual_seed(1))
    want = target_ranks(u @ it.T, target)
    assert torch.equal(tiled_target_ranks(u, it, target, tile_columns=512), want)
    assert torch.equal(chunked_target_ranks(u, it, target, chunk=9, tiled=False), want)
    with pytest.raises(ValueError, match="target ids"):
        tiled_target_ranks(u, it, torch.zeros(70, dtype=torch.long))
    with pytest.raises(ValueError, match="target"):
        tiled_target_ranks(u, it, target[:5])
    bad = u.clone()
    bad[0, 0] = math.nan  # not finite: the untiled path, which checks the scores for NaN
    with pytest.raises(ValueError, match="NaN"):
        tiled_target_ranks(bad, it, target)
    bad[0, 0] = 1e300  # finite, but the product may overflow: the untiled path too
    assert torch.equal(tiled_target_ranks(bad, it, target)[1:], want[1:])


def test_tiled_ranks_count_equal_scores_against_the_target():
    """Scores equal in the products count against the target (pessimistic ties), also
    where a row dot product would round the target's score differently: a duplicate of
    every target item, and a degenerate model whose items are all one vector."""
    g = torch.Generator().manual_seed(0)
    u, it = torch.randn(1000, 64, generator=g), torch.randn(5001, 64, generator=g)
    it[5000] = it[7]
    target = torch.full((1000,), 7)
    target[::2] = torch.randint(1, 5000, (500,), generator=g)
    want = target_ranks(u @ it.T, target)
    got = tiled_target_ranks(u, it, target, tile_columns=1024)
    assert torch.equal(got, want)
    assert (got[1::2] >= 1).all()  # the duplicate always counts above target 7
    same = torch.randn(1, 64, generator=g).expand(300, 64).contiguous()  # items all alike
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # float64: GEMM ties vary
        r = tiled_target_ranks(u[:50].to(dtype), same.to(dtype), torch.randint(1, 300, (50,)))
        assert (r == 298).all(), dtype  # every other real item ties: rank N - 2
    # float16 holds integers exactly only to 2048: a row of 4,999 ties is summed wider
    many = same[:1].expand(5000, 64).contiguous().half()
    r = tiled_target_ranks(u[:20].half(), many, torch.randint(1, 5000, (20,)))
    assert (r == 4998).all()


def test_tiled_ranks_of_no_users_and_the_tile_bounds() -> None:
    """No users: an empty result from both entry points; tile widths up to 2^24 (the
    float row sums' exact range) are accepted, wider ones refused."""
    u, it = torch.randn(0, 4), torch.randn(10, 4)
    none = torch.zeros(0, dtype=torch.long)
    for ranks in (tiled_target_ranks(u, it, none), chunked_target_ranks(u, it, none)):
        assert ranks.shape == (0,) and ranks.dtype == torch.long
    users = torch.randn(3, 4)
    target = torch.tensor([1, 5, 9])
    want = target_ranks(users @ it.T, target)
    assert torch.equal(tiled_target_ranks(users, it, target, tile_columns=2**24), want)
    with pytest.raises(ValueError, match="2\\^24"):
        tiled_target_ranks(users, it, target, tile_columns=2**24 + 1)


def test_ranking_helpers_take_parameters_that_require_grad():
    """Embedding tables straight from a model (requires_grad) work: no out= error."""
    u = torch.nn.Parameter(torch.randn(20, 8))
    it = torch.nn.Parameter(torch.randn(3000, 8))
    target = torch.randint(1, 3000, (20,))
    want = target_ranks((u @ it.T).detach(), target)
    assert torch.equal(chunked_target_ranks(u, it, target), want)
    assert torch.equal(chunked_target_ranks(u, it, target, chunk=7, tiled=False), want)
    v, i = torch_topk_chunked(u, it, 5)
    assert torch.equal(i, torch_topk_chunked(u.detach(), it.detach(), 5, tiled=False)[1])
    assert not v.requires_grad


def test_tiled_topk_with_a_large_k_gathers_candidates_in_parts(monkeypatch):
    import bft_lightning.metrics.ranking as R

    monkeypatch.setattr(R, "RESCORE_ELEMENTS", 1000)  # a few users per gather
    u, it = _vectors(users=30, items=4001, dim=8, seed=11)
    v, i = R.torch_topk_tiled(u.double(), it.double(), 40, tile_columns=512)
    want_v, want_i = (u.double() @ it[1:].double().T).topk(40, dim=1)
    assert torch.equal(i, want_i + 1) and torch.allclose(v, want_v)


# ----------------------------------------------------------------- bfloat16 screen
needs_bf16_sums = pytest.mark.skipif(
    not ranking.bf16_matmul_accumulates_in_float32(),
    reason="this CPU's bfloat16 matrix product does not sum in float32",
)


def _float64_topk_sets(u, it, k):
    """The reference top-k ids (padding left out) and the smallest gap between the
    k-th and the (k+1)-th score, which must exceed float32 rounding for a fair test."""
    full = u.double() @ it[1:].double().T
    top = full.topk(k + 1, dim=1).values
    ids = full.topk(k, dim=1).indices + 1
    return ids.sort(1).values, (top[:, k - 1] - top[:, k]).min().item()


@needs_bf16_sums
@pytest.mark.parametrize("users, items, dim, k, tile_users, tile_columns, group", [
    (300, 20001, 64, 10, 128, 4096, 8),  # several blocks and tiles, tail columns
    (70, 6000, 33, 5, 32, 1000, 8),       # an odd dimension, a partial last block
    (40, 3000, 16, 25, 40, 512, 4),       # k larger than the extra groups
    (9, 200, 8, 1, 4, 4096, 16),          # 12 groups, all of them picked; 8 tail columns
])  # fmt: skip
def test_screened_topk_equals_the_float64_top_k(
    users, items, dim, k, tile_users, tile_columns, group
):
    u, it = _vectors(users=users, items=items, dim=dim, seed=users + items)
    want, gap = _float64_topk_sets(u, it, k)
    assert gap > 1e-5  # no near-tie that float32 rounding could flip
    kw = dict(tile_users=tile_users, tile_columns=tile_columns, group=group)
    v, i = torch_topk_tiled(u, it, k, screen=True, **kw)
    assert torch.equal(i.sort(1).values, want)
    v32, i32 = torch_topk_tiled(u, it, k, screen=False, **kw)
    assert torch.equal(i.sort(1).values, i32.sort(1).values)
    assert torch.allclose(v, v32, rtol=1e-6, atol=1e-5)  # float32 scores, best first
    assert torch.equal(v, v.sort(1, descending=True).values)


@needs_bf16_sums
def test_screened_topk_falls_back_where_near_ties_crowd_the_bound(monkeypatch):
    """3,000 items within ~1e-2 of one vector that 16 users score far above the
    rest: more groups lie within the screen's bound of their k-th score than it
    rescores, so those users are scored in full; the result is still the exact
    top k."""
    g = torch.Generator().manual_seed(6)
    u = torch.randn(64, 32, generator=g)
    it = torch.randn(20001, 32, generator=g)
    direction = u[:16].mean(0)
    direction /= direction.norm()
    it[1:3001] = 10.0 * direction + 1e-2 * torch.randn(3000, 32, generator=g)
    u[:16] = direction + 0.01 * torch.randn(16, 32, generator=g)
    unsettled = []
    select = ranking._Screen.select

    def spy(self, maxima, a):
        best, settled = select(self, maxima, a)
        unsettled.append(int((~settled).sum()))
        return best, settled

    monkeypatch.setattr(ranking._Screen, "select", spy)
    want, gap = _float64_topk_sets(u, it, 10)
    assert gap > 1e-5
    _, i = torch_topk_tiled(u, it, 10, tile_users=32, screen=True)
    assert sum(unsettled) >= 16  # the aligned users took the fallback
    assert torch.equal(i.sort(1).values, want)


@needs_bf16_sums
@pytest.mark.parametrize("scale_u, scale_i", [(1e-18, 1e-15), (1e12, 1e10), (1.0, 1e-30)])
def test_screened_topk_is_exact_at_any_scale(scale_u, scale_i):
    """The bound scales with the vectors (no absolute tolerance hides in it)."""
    u, it = _vectors(users=50, items=8001, dim=24, seed=9)
    u, it = u * scale_u, it * scale_i
    want, _ = _float64_topk_sets(u, it, 10)
    _, i = torch_topk_tiled(u, it, 10, screen=True)
    assert torch.equal(i.sort(1).values, want)


@needs_bf16_sums
@pytest.mark.parametrize("dim, items, scale", [
    (1, 3000, 1.0), (2, 3000, 1.0), (64, 5000, 1.0), (512, 2000, 1.0),
    (16, 2000, 1e-20),  # products below 2^-126: the hardware flushes them to zero
])  # fmt: skip
def test_screen_bound_holds_for_every_score(dim, items, scale):
    """The certificate itself, on the tile products as the top-k makes them (column
    slices of the bfloat16 items into a reused buffer): every screened, centred
    score is within its user's bound plus the rounding term of the exact one, for
    heavy-tailed vectors; at d = 1, 2 the bound is nearly reached (half of it would
    fail), and for tiny vectors only the flush term covers the error."""
    g = torch.Generator().manual_seed(dim)
    users = torch.randn(40, dim, generator=g) * torch.rand(40, 1, generator=g).pow(-2)
    it = torch.randn(items, dim, generator=g).pow(3) * scale
    users = users * scale
    scr = ranking._Screen(it, k=10, picked=24)
    ub, bound = scr.block(users)
    width = 1000
    buf = torch.empty(40, width, dtype=torch.bfloat16)
    worst = 0.0
    for j0 in range(0, items, width):
        w = min(width, items - j0)
        tile = torch.mm(ub, scr.items_t[:, j0 : j0 + w], out=buf[:, :w]).double()
        exact = users.double() @ it[j0 : j0 + w].double().T + ub[:, -1:].double()
        slack = bound[:, None] + ranking._ROUND_BF16 * tile.abs()
        assert ((tile - exact).abs() <= slack).all()
        worst = max(worst, ((tile - exact).abs() / slack).max().item())
    if dim <= 2:
        assert worst > 0.5  # a bound half as large would not hold


@needs_bf16_sums
@pytest.mark.parametrize("k", [10, 50])
def test_screen_settles_most_users(monkeypatch, k):
    """On Gaussian vectors the bound settles the top k of nearly every user (the
    rescored groups grow with k), so the screen does not turn into the fallback."""
    counts = []
    select = ranking._Screen.select

    def spy(self, maxima, a):
        best, settled = select(self, maxima, a)
        counts.append((int(settled.sum()), settled.numel()))
        return best, settled

    monkeypatch.setattr(ranking._Screen, "select", spy)
    u, it = _vectors(users=600, items=20001, dim=64, seed=k)
    torch_topk_tiled(u, it, k, screen=True)
    settled, total = map(sum, zip(*counts))
    assert total == 600 and settled >= 0.95 * total


def test_screen_samples_items_past_2_24():
    """The centre's sample indices stay in range where float32 cannot hold n - 1."""
    scr = ranking._Screen(torch.zeros(2**24 + 4, 1), k=1, picked=15)
    assert scr.sample_t.shape == (1, ranking.SCREEN_SAMPLE)


def test_topk_over_tiles_equals_topk():
    u, it = _vectors(users=7, items=1000, dim=8, seed=2)
    v, i = ranking._topk_over_tiles(u, it.T.contiguous(), 9, width=64)  # last tile: 40
    want_v, want_i = (u @ it.T).topk(9, dim=1)
    assert torch.equal(i, want_i) and torch.equal(v, want_v)


def test_screen_is_skipped_where_it_cannot_be_bounded():
    """float64 inputs, non-finite or overflowing vectors: the float32 tiles only."""
    u, it = _vectors(users=20, items=3001, dim=8, seed=4)
    assert not ranking._screen_applies(u.double(), it.double(), True, 5)
    bad = it.clone()
    bad[7, 0] = math.inf
    assert not ranking._screen_applies(u, bad, True, 5)
    assert not ranking._screen_applies(u * 1e20, it * 1e20, True, 5)
    assert not ranking._screen_applies(u, it, False, 5)
    assert not ranking._screen_applies(u, it, None, 5)  # 3,000 items: too few to pay
    assert isinstance(ranking.fast_bf16_matmul(), bool)
    v, i = torch_topk_tiled(u[:0], it, 5, screen=None)  # no users: empty results
    assert v.shape == i.shape == (0, 5) and i.dtype == torch.long
    v, i = torch_topk_tiled(u, it, 5)  # the default (screened or not) is the exact top-k
    want, _ = _float64_topk_sets(u, it, 5)
    assert torch.equal(i.sort(1).values, want)
