"""Batches: teacher-forcing tensors and left-padded prompts (``collate_qa``), plain-text
chunks (``text_chunks``, ``collate_text``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .encoding import EncodedExample

IGNORE_INDEX = -100


def collate_qa(items: Sequence[EncodedExample], pad_id: int) -> dict[str, Any]:
    """Teacher-forcing tensors (right-padded) plus left-padded prompts for generation.

    input_ids, attention_mask, labels: (B, T) with ``labels[t]`` the target of
    position ``t`` (``-100`` outside the answer); prompt_ids, prompt_mask: (B, P);
    answers: gold strings; ids; context_tokens: (B,) prompt lengths; index: (B,)
    positions in the split (-1 where unknown).
    """
    b = len(items)
    seqs = [it.prompt + it.answer for it in items]
    t = max(len(s) - 1 for s in seqs)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    labels = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
    p = max(len(it.prompt) for it in items)
    prompt_ids = torch.full((b, p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(b, p, dtype=torch.long)
    for i, (it, s) in enumerate(zip(items, seqs)):
        n, m = len(s) - 1, len(it.prompt)
        input_ids[i, :n] = torch.tensor(s[:-1])
        mask[i, :n] = 1
        labels[i, m - 1 : m - 1 + len(it.labels)] = torch.tensor(it.labels)
        prompt_ids[i, p - m :] = torch.tensor(it.prompt)
        prompt_mask[i, p - m :] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": labels,
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "answers": [it.answers for it in items],
        "ids": [it.id for it in items],
        "context_tokens": torch.tensor([len(it.prompt) for it in items]),
        "index": torch.tensor([it.index for it in items], dtype=torch.long),
        "n_distractors": torch.tensor([it.n_distractors for it in items]),
    }


class _Collate:
    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: Sequence[EncodedExample]) -> dict[str, Any]:
        return collate_qa(items, self.pad_id)


def text_chunks(ids: Sequence[int], length: int) -> list[list[int]]:
    """Non-overlapping chunks of ``length + 1`` tokens (inputs plus shifted targets)."""
    n = (len(ids) - 1) // length
    return [list(ids[i * length : i * length + length + 1]) for i in range(n)]


def document_rows(documents: Sequence[Sequence[int]], length: int) -> list[list[int]]:
    """Whole documents packed greedily into rows of at most ``length + 1`` tokens.

    A document starts a new row when it does not fit in what is left of the
    current one, so no document is cut at a row boundary unless it is longer
    than a row by itself (then it takes rows of its own, cut every ``length``
    tokens with one token of overlap, as :func:`text_chunks`). Every target is
    kept (a row of one token, which has none, is not emitted); rows are ragged
    (:func:`collate_rows` pads them).
    """
    rows: list[list[int]] = []
    cur: list[int] = []

    def flush() -> None:
        if len(cur) > 1:
            rows.append(list(cur))
        cur.clear()

    for doc in documents:
        doc = list(doc)
        if len(doc) > length + 1:
            flush()
            rows.extend(doc[i : i + length + 1] for i in range(0, len(doc) - 1, length))
        else:
            if len(cur) + len(doc) > length + 1:
                flush()
            cur += doc
    flush()
    return rows


def collate_rows(rows: Sequence[Sequence[int]], pad_id: int) -> dict[str, Tensor]:
    """Right-padded next-token tensors for ragged rows; padding is masked out of the loss."""
    t = max(len(r) for r in rows) - 1
    input_ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    labels = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r) - 1
        input_ids[i, :n] = torch.tensor(r[:-1])
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(r[1:])
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def collate_text(chunks: Sequence[Sequence[int]]) -> dict[str, Tensor]:
    x = torch.tensor([list(c) for c in chunks], dtype=torch.long)
    return {
        "input_ids": x[:, :-1],
        "attention_mask": torch.ones_like(x[:, :-1]),
        "labels": x[:, 1:],
    }
