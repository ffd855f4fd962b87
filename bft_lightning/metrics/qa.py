"""Exact match and F1 for extractive QA, with SQuAD's official normalisation.

The logic is that of the official SQuAD evaluation scripts (v1.1, and v2.0
for unanswerable questions): lower-case, strip punctuation, drop the articles
``a``, ``an``, ``the``, collapse whitespace; F1 over the bag of normalised
tokens; the score of a prediction is the maximum over the gold answers. A
question with no (non-empty) gold answer is scored against ``""``: only an
empty prediction gets EM = F1 = 1 (v2.0's rule).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_scores(prediction: str, golds: Sequence[str]) -> tuple[float, float]:
    """(EM, F1) of one prediction: the maximum over the gold answers."""
    refs = [g for g in golds if normalize_answer(g)] or [""]
    return max(exact_match(prediction, g) for g in refs), max(f1(prediction, g) for g in refs)


class QAScore(Metric):
    """Mean EM and F1 (in [0, 1]) over questions, summed states (exact under DDP)."""

    full_state_update = False
    higher_is_better = True
    em_sum: Tensor
    f1_sum: Tensor
    count: Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.add_state("em_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("f1_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, predictions: Sequence[str], golds: Sequence[Sequence[str]]) -> None:  # type: ignore[override]
        if len(predictions) != len(golds):
            raise ValueError(f"{len(predictions)} predictions for {len(golds)} gold lists")
        for pred, gold in zip(predictions, golds):
            em, f = qa_scores(pred, gold)
            self.em_sum += em
            self.f1_sum += f
        self.count += len(predictions)

    def compute(self) -> dict[str, Tensor]:  # type: ignore[override]
        n = self.count.clamp_min(1).double()
        return {"em": (self.em_sum / n).float(), "f1": (self.f1_sum / n).float()}
