"""The two kinds of noise: label corruption (``corrupt_labels``) and distractor passages
(``arrange_passages`` from the dataset or from a split's ``passage_pool``)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from .examples import Passage, QAExample

DISTRACTOR_SOURCES = ("auto", "other_articles", "same_article", "dataset")


def corrupt_labels(
    labels: Sequence[int], rate: float, vocab_size: int, special: set[int], rng: np.random.Generator
) -> list[int]:
    """Replace each label but the last (EOS) w.p. ``rate`` by a uniform other non-special id."""
    out = list(labels)
    for i in range(len(out) - 1):
        if rng.random() < rate:
            while True:
                new = int(rng.integers(vocab_size))
                if new != out[i] and new not in special:
                    break
            out[i] = new
    return out


def arrange_passages(
    ex: QAExample,
    k: int,
    source: str,
    pool: Sequence[tuple[str, Passage]],
    rng: np.random.Generator,
) -> list[Passage]:
    """The gold passages inserted at random positions among ``k`` distractors.

    Fewer than ``k`` when the source has fewer candidates (the caller counts and
    reports them). Passages drawn from the split (``other_articles``,
    ``same_article``) that contain an accepted answer as a phrase are not
    candidates: they would answer the question, not distract from it (the
    dataset's own distractors are taken as the dataset defines them).
    """
    if k <= 0:
        return ex.gold
    if source == "auto":
        source = "dataset" if ex.distractors else "other_articles"
    if source == "dataset":
        cand = ex.distractors
    else:
        gold_text = {p.text for p in ex.gold}
        same = source == "same_article"
        answers = [
            re.compile(r"(?<!\w)" + re.escape(a.strip()) + r"(?!\w)", re.IGNORECASE)
            for a in ex.answers
            if a.strip()
        ]
        cand = [
            p
            for g, p in pool
            if (g == ex.group) == same
            and p.text not in gold_text
            and not any(a.search(p.text) for a in answers)
        ]
    picks = [cand[i] for i in rng.choice(len(cand), size=min(k, len(cand)), replace=False)]
    out = [Passage(p.text, p.title, gold=False) for p in picks]
    for g in ex.gold:
        out.insert(int(rng.integers(len(out) + 1)), g)
    return out


def passage_pool(examples: Sequence[QAExample]) -> list[tuple[str, Passage]]:
    """Distinct gold passages of a split, with their group."""
    seen: set[str] = set()
    pool = []
    for ex in examples:
        for p in ex.gold:
            if p.text not in seen:
                seen.add(p.text)
                pool.append((ex.group, p))
    return pool
