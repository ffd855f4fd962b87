"""EM/F1 with SQuAD's official normalisation, cross-checked against torchmetrics' copy of it."""

from __future__ import annotations

import random

import pytest
import torch

from bft_lightning.lm.metrics import QAScore, exact_match, f1, normalize_answer, qa_scores


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Denver Broncos!", "denver broncos"),
        ("  an   apple, a day ", "apple day"),
        ("Theory of the Atom", "theory of atom"),
        ("U.S.A.", "usa"),
        ("the", ""),
        ("Thebes", "thebes"),  # articles only as whole words
    ],
)
def test_normalisation(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_known_cases() -> None:
    assert exact_match("the Denver Broncos", "Denver Broncos") == 1.0
    assert f1("Broncos", "Denver Broncos") == pytest.approx(2 / 3)
    assert f1("Denver Broncos won", "Denver Broncos") == pytest.approx(0.8)
    assert f1("Carolina Panthers", "Denver Broncos") == 0.0
    # max over gold answers
    assert qa_scores("Santa Clara", ["Levi's Stadium", "Santa Clara, California"]) == (
        0.0,
        pytest.approx(0.8),
    )
    # SQuAD v2.0: no gold answer -> only the empty prediction scores
    assert qa_scores("", []) == (1.0, 1.0)
    assert qa_scores("Paris", []) == (0.0, 0.0)
    assert qa_scores("", ["Paris"]) == (0.0, 0.0)
    assert qa_scores("x", ["the", "x"]) == (1.0, 1.0)  # v2.0 drops golds that normalise to ""


def test_agrees_with_torchmetrics_squad() -> None:
    """Random cases; golds that normalise to "" are left out: SQuAD v2.0's script drops
    them (we follow it), v1.1's and torchmetrics' keep them (and disagree on F1)."""
    from torchmetrics.functional.text import squad

    rng = random.Random(0)
    vocab = ["the", "a", "Denver", "Broncos", "won", "1856", "Tesla,", "an", "U.S.", "Paris!"]
    for i in range(200):
        pred = " ".join(rng.choices(vocab, k=rng.randint(1, 5)))
        golds = [" ".join(rng.choices(vocab, k=rng.randint(1, 4))) for _ in range(3)]
        if not all(normalize_answer(g) for g in golds):
            continue
        ref = squad(
            {"prediction_text": pred, "id": str(i)},
            {"answers": {"answer_start": [0] * 3, "text": golds}, "id": str(i)},
        )
        em, f = qa_scores(pred, golds)
        assert 100 * em == pytest.approx(float(ref["exact_match"]))
        assert 100 * f == pytest.approx(float(ref["f1"]), abs=1e-4)


def test_metric_accumulates() -> None:
    m = QAScore()
    m.update(["Denver Broncos", "Panthers"], [["Denver Broncos"], ["Carolina Panthers"]])
    m.update(["x"], [["y"]])
    out = m.compute()
    assert out["em"] == pytest.approx(1 / 3)
    assert out["f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert m.count == torch.tensor(3)
    with pytest.raises(ValueError):
        m.update(["a"], [])


def test_a_question_scored_twice_counts_once() -> None:
    """With positions, a repeated question (DistributedSampler's padding under DDP)
    counts once, also once the per-process lists are concatenated into tensors (what
    a DDP sync leaves); rows without positions still all count."""
    m = QAScore()
    m.update(["paris", "blue"], [["Paris"], ["red"]], index=torch.tensor([0, 1]))
    m.update(["paris"], [["Paris"]], index=torch.tensor([0]))  # question 0 again
    assert m.rows == 3
    assert m.compute()["em"].item() == pytest.approx(0.5)
    synced = QAScore()
    synced.index = torch.tensor([1, 0, 0])  # type: ignore[assignment]
    synced.em = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)  # type: ignore[assignment]
    synced.f1 = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)  # type: ignore[assignment]
    assert synced.compute()["f1"].item() == pytest.approx(0.5)
    plain = QAScore()
    plain.update(["paris", "paris"], [["Paris"], ["Paris"]])
    plain.update(["x"], [["Paris"]], index=[-1])  # unknown position: counted as a row
    assert plain.compute()["em"].item() == pytest.approx(2 / 3)
