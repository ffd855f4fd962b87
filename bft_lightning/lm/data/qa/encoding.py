"""Tokenisation and prompt building: the BPE tokenizer, the target answer and its span, and
``encode_example``: ``BOS passages "\\n\\nQuestion: q\\nAnswer:" " answer" EOS``, cropped
to fit."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bft_lightning.lm.llama_format import TextTokenizer, load_tokenizer

from .examples import Passage, QAExample

PASSAGE_SEP = "\n\n"
QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, path: str | Path) -> TextTokenizer:
    """A byte-level BPE tokenizer trained on ``texts`` (specials ``<pad>``, ``<s>``, ``</s>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:  # a temporary file and a rename: an interrupted save never leaves a damaged tokenizer
        tok.save(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return load_tokenizer(path)


def _answer_token_span(
    offsets: Sequence[tuple[int, int]], start: int, end: int
) -> tuple[int, int] | None:
    """First and last token index overlapping the char span [start, end)."""
    hit = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return (hit[0], hit[-1]) if hit else None


def _locate(ex: QAExample, gold: Passage, ans: str) -> tuple[int, int] | None:
    """Character span of ``ans`` in ``gold`` (exact, else case-insensitive), or None."""
    if not ans:
        return None
    if ex.answer_start is not None and gold is ex.gold[0] and ans == ex.answers[0]:
        if gold.text[ex.answer_start : ex.answer_start + len(ans)] == ans:
            return ex.answer_start, ex.answer_start + len(ans)
    i = gold.text.find(ans)
    if i < 0:
        i = gold.text.lower().find(ans.lower())
    return (i, i + len(ans)) if i >= 0 else None


def target_answer(ex: QAExample) -> tuple[str, Passage | None]:
    """The answer a model is trained to produce, and the gold passage that holds it.

    The first of ``ex.answers`` found in a gold passage (some NQ-open
    questions list first an answer that their passage does not contain, while
    another listed answer is there, ``results/perf/notes.md``: training on the
    first would teach an answer the prompt does not show, and the crop would
    not keep the one it does);
    else the first answer, with no passage.
    """
    for ans in ex.answers:
        for g in ex.gold:
            if _locate(ex, g, ans) is not None:
                return ans, g
    return (ex.answers[0] if ex.answers else ""), None


@dataclass
class EncodedExample:
    """Token ids of one question; ``labels`` are the (possibly corrupted) answer targets."""

    id: str
    prompt: list[int]
    answer: list[int]
    labels: list[int]
    answers: list[str]
    n_passages: int
    n_distractors: int
    gold_index: list[int] = field(default_factory=list)
    index: int = -1  # position in its split (the QA metric counts each once under DDP)


def crop_around(
    ids: list[int],
    span: tuple[int, int] | None,
    width: int,
    rng: np.random.Generator | None = None,
) -> tuple[list[int], tuple[int, int] | None]:
    """At most ``width`` tokens of ``ids``; a window that contains ``span`` when given.

    The window's offset is uniform over the windows that contain the span
    (so the answer's place in the window carries no signal); without ``rng``
    the window is centred on the span. Without a span the head is kept.
    Returns the window and the span's position in it.
    """
    if len(ids) <= width:
        return ids, span
    if span is None:
        return ids[:width], None
    lo, hi = span
    if hi - lo + 1 > width:
        raise ValueError("answer span longer than the window")
    first, last = max(0, hi + 1 - width), min(lo, len(ids) - width)
    if rng is None:
        start = min(max((lo + hi + 1) // 2 - width // 2, first), last)
    else:
        start = int(rng.integers(first, last + 1))
    return ids[start : start + width], (lo - start, hi - start)


def encode_example(
    ex: QAExample,
    tok: TextTokenizer,
    passages: Sequence[Passage],
    max_length: int,
    max_answer_tokens: int,
    max_passage_tokens: int | None = None,
    rng: np.random.Generator | None = None,
) -> EncodedExample | None:
    """Tokenise ``passages`` (gold among distractors, in order) + question + answer.

    Each passage is first cut to ``max_passage_tokens`` (the answer-bearing gold
    passage to a window that contains the answer, :func:`target_answer`). Then ``max_length`` is met
    by dropping distractors (last first), then cropping gold passages the same
    way. None if the answer itself cannot fit.

    The first passage is encoded as the start of a document (a sentencepiece
    tokenizer's start marker), the rest, the question and the answer as
    continuations. When the first passage is a distractor dropped for length,
    the passage that then follows BOS keeps its continuation encoding (one
    token differs from running text); left so, since re-encoding it would
    move its crop and answer span.
    """
    answer_text, answer_gold = target_answer(ex)
    answer = (tok.encode(" " + answer_text) if answer_text else []) + [tok.eos_id]
    if len(answer) - 1 > max_answer_tokens:
        return None
    question = tok.encode(QUESTION_TEMPLATE.format(question=ex.question.strip()))
    sep = tok.encode(PASSAGE_SEP)
    budget = max_length - 1 - len(question) - len(answer)  # 1 for BOS
    bodies: list[list[int]] = []
    spans: list[tuple[int, int] | None] = []
    for n, p in enumerate(passages):
        span = None
        first = n == 0  # right after BOS: the start of the document, not a continuation
        if p is answer_gold:
            ids, offsets = tok.encode_with_offsets(p.text, start=first)
            char_span = _locate(ex, p, answer_text)
            assert char_span is not None
            span = _answer_token_span(offsets, *char_span)
        else:
            ids = tok.encode(p.text, start=first)
        if max_passage_tokens is not None and len(ids) > max_passage_tokens:
            if span is not None and span[1] - span[0] + 1 > max_passage_tokens:
                return None
            ids, span = crop_around(ids, span, max_passage_tokens, rng)
        bodies.append(ids)
        spans.append(span)
    keep = list(range(len(passages)))

    def total() -> int:
        return sum(len(bodies[i]) for i in keep) + len(sep) * max(len(keep) - 1, 0)

    for i in reversed(range(len(passages))):  # drop distractors, last first
        if total() <= budget:
            break
        if not passages[i].gold:
            keep.remove(i)
    if total() > budget:
        n = len(keep)
        room = budget - len(sep) * (n - 1)
        share = max(room // max(n, 1), 1)
        others = [i for i in keep if spans[i] is None]
        for i in others:
            bodies[i] = bodies[i][:share]  # no answer in these: keep the head
        rest = room - sum(len(bodies[i]) for i in others)
        for i in keep:
            span = spans[i]
            if span is not None:
                if span[1] - span[0] + 1 > rest:
                    return None
                bodies[i], spans[i] = crop_around(bodies[i], span, rest, rng)
    prompt = [tok.bos_id] if tok.bos_id is not None else []
    for n, i in enumerate(keep):
        prompt += (sep if n else []) + bodies[i]
    prompt += question
    gold_index = [n for n, i in enumerate(keep) if passages[i].gold]
    return EncodedExample(
        ex.id, prompt, answer, list(answer), list(ex.answers), len(keep),
        len(keep) - len(gold_index), gold_index,
    )  # fmt: skip
