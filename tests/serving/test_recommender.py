"""Recommender: raw ids in and out, through the API a user calls."""

from __future__ import annotations

import math

import pytest
import torch
from recdata import FIRST, NUM_ITEMS, successor

from bft_lightning import Recommender
from bft_lightning.serving import UnknownItemsError


@pytest.fixture(scope="module")
def rec(trained) -> Recommender:
    return Recommender.from_checkpoint(trained[0], device="cpu")


def runs(n: int = 4) -> list[list[str]]:
    """One history of ``n`` consecutive items ending at each of the 20 items."""
    return [[str(FIRST + (end - j) % NUM_ITEMS) for j in range(n - 1, -1, -1)]
            for end in range(NUM_ITEMS)]  # fmt: skip


def test_from_checkpoint_rebuilds_an_eval_model(rec: Recommender) -> None:
    assert not rec.model.training
    assert rec.num_items == NUM_ITEMS and rec.max_len == 8
    assert sorted(rec.item_ids[1:]) == [str(FIRST + i) for i in range(NUM_ITEMS)]


def test_recommends_the_known_successor_as_raw_ids(rec: Recommender) -> None:
    histories = runs()
    out = rec.recommend(histories, k=5)
    hits = [r.items[0] == successor(h[-1]) for h, r in zip(histories, out)]
    assert sum(hits) >= 18, [r.items[:2] for r in out]  # a random top-1 hits 1 in 20
    for r in out:
        assert len(r.items) == len(r.scores) == 5 and len(set(r.items)) == 5
        assert r.scores == sorted(r.scores, reverse=True)
        assert 0.0 < r.confidence <= 1.0 and not r.unknown and not r.cold


def test_int_and_string_ids_are_the_same_item(rec: Recommender) -> None:
    as_str = rec.recommend([["1003", "1004"]], k=3)[0]
    as_int = rec.recommend([[1003, 1004]], k=3)[0]
    assert as_int.items == as_str.items and as_int.scores == pytest.approx(as_str.scores)


def test_batches_give_the_same_results(rec: Recommender) -> None:
    histories = runs(3) + runs(7) + [["1001"]]
    one = rec.recommend(histories, k=4, batch_size=1)
    many = rec.recommend(histories, k=4, batch_size=16)
    assert [r.items for r in one] == [r.items for r in many]
    for a, b in zip(one, many):
        assert a.scores == pytest.approx(b.scores, abs=1e-5)
        assert a.confidence == pytest.approx(b.confidence, abs=1e-5)


def test_exclude_seen(rec: Recommender) -> None:
    history = ["1003", "1004", "1005", "1004"]
    plain = rec.recommend([history], k=NUM_ITEMS, exclude_seen=False)[0]
    assert set(history) <= set(plain.items)
    out = rec.recommend([history], k=NUM_ITEMS, exclude_seen=True)[0]
    assert not set(history) & set(out.items)
    assert len(out.items) == NUM_ITEMS - 3  # fewer than k only when fewer remain
    assert out.items == [i for i in plain.items if i not in history]


def test_unknown_ids_are_skipped_and_counted(rec: Recommender) -> None:
    out = rec.recommend([["1003", "nope", "1004", 99]], k=3)[0]
    assert out.unknown == ("nope", "99")
    clean = rec.recommend([["1003", "1004"]], k=3)[0]
    assert out.items == clean.items and out.scores == pytest.approx(clean.scores)


def test_no_known_id_is_an_error_naming_them(rec: Recommender) -> None:
    with pytest.raises(UnknownItemsError, match=r"history 1: .*'x1', 'x2'") as err:
        rec.recommend([["1001"], ["x1", "x2"]], k=3)
    assert err.value.position == 1 and err.value.ids == ("x1", "x2")


def test_cold_user_gets_the_most_popular_items(rec: Recommender, trained) -> None:
    out = rec.recommend([[]], k=5)[0]
    assert out.cold and len(out.items) == 5 and out.scores == sorted(out.scores, reverse=True)
    counts = {}
    for line in trained[1].read_text().splitlines():
        for item in line.split()[1:-2]:  # the training parts
            counts[item] = counts.get(item, 0) + 1
    top = sorted(counts.values(), reverse=True)[:5]
    assert [counts[i] for i in out.items] == top
    total = sum(counts.values())
    expected = sum((c + 1) / (total + NUM_ITEMS) for c in top)
    assert out.confidence == pytest.approx(expected, rel=1e-5)
    mixed = rec.recommend([["1001", "1002"], []], k=5)
    assert mixed[1] == out and not mixed[0].cold


def test_long_history_reads_its_last_max_len_items(rec: Recommender) -> None:
    long = runs(3 * rec.max_len)[5]
    # seen items kept: excluded, the whole history would be left out, not the window's
    out = rec.recommend([long], k=4, exclude_seen=False)[0]
    tail = rec.recommend([long[-rec.max_len :]], k=4, exclude_seen=False)[0]
    assert out.items == tail.items and out.scores == pytest.approx(tail.scores, abs=1e-6)
    assert out.items[0] == successor(long[-1])


@pytest.mark.parametrize("k", [0, -1, NUM_ITEMS + 1, 2.5, "3", True])
def test_k_out_of_range_names_k(rec: Recommender, k) -> None:
    with pytest.raises(ValueError, match=rf"k must be an integer in 1\.\.{NUM_ITEMS}.*{k!r}"):
        rec.recommend([["1001"]], k=k)


def test_k_equal_to_the_item_count(rec: Recommender) -> None:
    out = rec.recommend([["1001"]], k=NUM_ITEMS, exclude_seen=False)[0]
    assert sorted(out.items) == sorted(rec.item_ids[1:])


@pytest.mark.parametrize(
    "histories, match",
    [("1001", "list of histories"), (["1001"], "history 0: expected a list"),
     ([[1.5]], r"history 0, item 0: expected a string or integer"),
     ([["1001"], [None]], r"history 1, item 0")],
)  # fmt: skip
def test_malformed_histories_are_named(rec: Recommender, histories, match) -> None:
    with pytest.raises(ValueError, match=match):
        rec.recommend(histories, k=3)


def test_no_gradients_and_deterministic(rec: Recommender) -> None:
    calls = []
    handle = rec.model.final_norm.register_forward_hook(
        lambda m, i, o: calls.append((torch.is_grad_enabled(), o.requires_grad))
    )
    try:
        a = rec.recommend(runs(), k=3)
        b = rec.recommend(runs(), k=3)
    finally:
        handle.remove()
    assert calls and all(c == (False, False) for c in calls)
    assert [r.scores for r in a] == [r.scores for r in b]


def test_precision_on_model_records_for_confidence_then_stops(tmp_path) -> None:
    from recdata import config, write_cyclic

    from bft_lightning.cli import main
    from bft_lightning.nn.stats import find_filter_layers

    data = write_cyclic(tmp_path / "c.txt", users=60)
    cfg = config(tmp_path / "c.yaml", data, tmp_path, max_epochs=1, precision="on")
    main(["fit", "--config", str(cfg)])
    rec = Recommender.from_checkpoint(tmp_path / "ckpt" / "best.ckpt")
    assert rec.model.precision == "on"
    out = rec.recommend(runs(), k=3)
    # precision "on": the final precision in the scored state's units (a log scale,
    # docs/confidence.md), not a probability; it must be finite and vary by history
    assert all(math.isfinite(r.confidence) for r in out)
    assert len({round(r.confidence, 6) for r in out}) > 1
    assert all(not layer.record for _, layer in find_filter_layers(rec.model))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(rec: Recommender, trained) -> None:
    gpu = Recommender.from_checkpoint(trained[0], device="cuda")
    a, b = rec.recommend(runs(), k=5), gpu.recommend(runs(), k=5)
    assert [r.items for r in a] == [r.items for r in b]
    for x, y in zip(a, b):
        assert x.scores == pytest.approx(y.scores, abs=1e-4)


def test_checkpoint_without_vocabulary_is_refused(trained, tmp_path) -> None:
    checkpoint = torch.load(trained[0], weights_only=True)
    del checkpoint["bft_lightning"]["vocabulary"]
    del checkpoint["bft_lightning"]["sealed"]  # as saved before checkpoints were sealed
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    with pytest.raises(ValueError, match=r"old\.ckpt: the checkpoint holds no item vocabulary"):
        Recommender.from_checkpoint(old)
