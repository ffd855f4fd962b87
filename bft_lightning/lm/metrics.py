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
from torchmetrics.utilities import dim_zero_cat

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
    """Mean EM and F1 (in [0, 1]) over questions, exact under DDP.

    Given each question's ``index`` (its position in the split), the scores are
    kept per question and a question scored twice (``DistributedSampler``
    repeats a few to even out the processes) counts once, so N processes give
    what one gives; without it, summed states (each row counts).
    """

    full_state_update = False
    higher_is_better = True
    em_sum: Tensor
    f1_sum: Tensor
    count: Tensor
    index: list[Tensor]
    em: list[Tensor]
    f1: list[Tensor]

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.add_state("em_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("f1_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        for name in ("index", "em", "f1"):
            self.add_state(name, [], dist_reduce_fx="cat")

    def update(  # type: ignore[override]
        self,
        predictions: Sequence[str],
        golds: Sequence[Sequence[str]],
        index: Tensor | Sequence[int] | None = None,
    ) -> None:
        if len(predictions) != len(golds):
            raise ValueError(f"{len(predictions)} predictions for {len(golds)} gold lists")
        scores = [qa_scores(pred, gold) for pred, gold in zip(predictions, golds)]
        idx = None if index is None else torch.as_tensor(index, dtype=torch.long).flatten()
        if idx is not None and (len(idx) != len(scores) or bool((idx < 0).any())):
            idx = None  # unknown positions: every row counts
        if idx is None:
            for em, f in scores:
                self.em_sum += em
                self.f1_sum += f
            self.count += len(scores)
            return
        device = self.count.device
        self.index.append(idx.to(device))
        self.em.append(torch.tensor([e for e, _ in scores], dtype=torch.float64, device=device))
        self.f1.append(torch.tensor([f for _, f in scores], dtype=torch.float64, device=device))

    @property
    def rows(self) -> int:
        """Rows scored by this process (before any reduction)."""
        return int(self.count) + sum(len(i) for i in self.index)

    def compute(self) -> dict[str, Tensor]:  # type: ignore[override]
        em, f1, n = self.em_sum.clone(), self.f1_sum.clone(), self.count.double()
        if len(self.index):  # a list, or one tensor after a DDP sync
            index = dim_zero_cat(self.index)
            first = _first_occurrence(index)
            em = em + dim_zero_cat(self.em)[first].sum()
            f1 = f1 + dim_zero_cat(self.f1)[first].sum()
            n = n + len(first)
        n = n.clamp_min(1)
        return {"em": (em / n).float(), "f1": (f1 / n).float()}


def _first_occurrence(index: Tensor) -> Tensor:
    """Positions of the first occurrence of each distinct value of ``index``."""
    order = torch.argsort(index, stable=True)
    sorted_index = index[order]
    new = torch.ones_like(sorted_index, dtype=torch.bool)
    new[1:] = sorted_index[1:] != sorted_index[:-1]
    return order[new]
