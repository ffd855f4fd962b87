"""Generated extractive QA: entity-relation-value facts, a question, distractor passages.

A small model trained on this machine can learn it well (so label noise has
room to hurt), and nothing outside the library is needed: the vocabulary is
closed (a word-level tokenizer built here, one token per word) and every
example is drawn from a seeded generator in a fraction of a second.

One example (a "world"):

- the *gold* passage about an entity ``e``: ``facts_per_passage`` facts with
  distinct relations, each a sentence ``<e> <relation> <value> .``;
  a value is 1 to ``max_value_words`` words of that relation's word list, so
  answers are multi-token spans and F1 differs from EM;
- a question about one of those facts,
  ``Question : what is the <relation> of <e> ? Answer :``; the answer is the
  value, a span copied from the gold passage;
- ``max_distractors`` passages about other entities (never ``e``); each has a
  fact of the question's relation with another value (a distractor that only
  the entity tells apart), plus facts of other relations. The first ``k``
  (``num_distractors``) are used, the gold passage at a seeded position among
  them, so the question, answer and gold passage are the same whatever ``k``.

Every example is new (random entity, relations, values): the task cannot be
memorised, only read from the context. The worlds depend on ``data_seed``
(fixed across training seeds, so test questions are paired across methods);
the label noise depends on ``seed``.

Label noise (``noise_rate``): exactly ``round(noise_rate * N)`` of the N
answer tokens (not the EOS) of the training split are replaced, each by a
token drawn uniformly from the non-special vocabulary minus the original (as
:func:`bft_lightning.lm.data.qa.corrupt_labels` does); which ones is
recorded (:attr:`SyntheticQAExample.corrupted`, and the ``label_corrupted``
mask of a batch). By default only the targets are corrupted and the inputs
read the clean answer (teacher forcing, as :class:`~bft_lightning.lm.data.qa.QADataModule`);
``noise_in_inputs=True`` corrupts the answer text itself (input and target),
as a noisy SFT corpus is.

Batches follow the ``QADataModule`` contract (:func:`~bft_lightning.lm.data.qa.collate_qa`)
so :class:`~bft_lightning.lm.task.LanguageSFT` trains and scores them;
``SyntheticQAPretrainDataModule`` gives the plain-text pretraining stage.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from bft_lightning.lm.data.qa import (
    EncodedExample,
    collate_qa,
    collate_rows,
    collate_text,
    document_rows,
    text_chunks,
)
from bft_lightning.lm.data.synthetic_world import (  # noqa: F401  (the world's names, here too)
    BOS,
    EOS,
    FACT_ORDERS,
    PAD,
    RELATIONS,
    SPECIALS,
    STRUCTURE,
    Fact,
    SyntheticWorld,
    _rng,
    _value,
    build_vocabulary,
    entity_names,
    generate_world,
    word_tokenizer,
)
from bft_lightning.lm.llama_format import TextTokenizer
from bft_lightning.nn.checks import check_int, check_number, check_sizes


@dataclass
class SyntheticQAExample(EncodedExample):
    """An encoded example plus which answer tokens (indices into ``answer``) are corrupted,
    the gold passage's token span in ``prompt`` and the answer's span in it."""

    corrupted: list[int] = field(default_factory=list)
    gold_span: tuple[int, int] = (0, 0)
    answer_span: tuple[int, int] = (0, 0)  # [start, end) of the answer in ``prompt``


class SyntheticQADataModule(L.LightningDataModule):
    """Generated extractive QA (see the module docstring) for :class:`LanguageSFT`.

    Args:
        num_train, num_val, num_test: questions per split.
        num_distractors: ``k`` distractor passages per question (at most ``max_distractors``).
        max_distractors: distractors generated per question (the first ``k`` are used).
        facts_per_passage: facts per passage (distinct relations, at most 8).
        max_value_words: longest value (answer) in words.
        num_entities: size of the entity vocabulary.
        noise_rate: fraction of training answer tokens whose label is corrupted.
        noise_in_inputs: corrupt the answer tokens in the input too (default: labels only).
        fact_order: a fact's words, ``entity_first`` (``niri pet goat .``) or
            ``relation_first`` (``pet niri goat .``): with one fact per passage the
            latter puts the entity, the only thing that tells the gold passage from a
            distractor, right before the value (a plain induction lookup).
        data_seed: seed of the generated questions (keep fixed across training seeds).
        seed: seed of the label noise.
        batch_size, eval_batch_size, num_workers: loaders.
    """

    def __init__(
        self,
        num_train: int = 4000,
        num_val: int = 200,
        num_test: int = 500,
        num_distractors: int = 0,
        max_distractors: int = 4,
        facts_per_passage: int = 4,
        max_value_words: int = 3,
        num_entities: int = 150,
        noise_rate: float = 0.0,
        noise_in_inputs: bool = False,
        fact_order: str = "entity_first",
        data_seed: int = 0,
        seed: int = 0,
        batch_size: int = 32,
        eval_batch_size: int = 100,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_sizes(
            num_train=num_train,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            max_value_words=max_value_words,
        )
        for name, value in (
            ("num_val", num_val),
            ("num_test", num_test),
            ("num_distractors", num_distractors),
            ("data_seed", data_seed),
            ("max_distractors", max_distractors),
            ("seed", seed),
            ("num_workers", num_workers),
        ):
            check_int(name, value, low=0)
        check_int("facts_per_passage", facts_per_passage, low=1)
        if facts_per_passage > len(RELATIONS):
            raise ValueError(
                f"facts_per_passage={facts_per_passage} exceeds the {len(RELATIONS)} relations"
            )
        if num_distractors > max_distractors:
            raise ValueError(
                f"num_distractors={num_distractors} exceeds max_distractors={max_distractors}"
            )
        if max_value_words > min(len(v) for v in RELATIONS.values()):
            raise ValueError(f"max_value_words={max_value_words} exceeds a relation's word list")
        if num_entities < 1 + max_distractors:
            raise ValueError(
                f"num_entities={num_entities} is fewer than 1 + max_distractors={max_distractors}"
            )
        check_number("noise_rate", noise_rate, 0.0, 1.0)
        if fact_order not in FACT_ORDERS:
            raise ValueError(f"fact_order must be one of {FACT_ORDERS}, got {fact_order!r}")
        self.fact_order = fact_order
        self.save_hyperparameters()
        self.num = {"train": num_train, "val": num_val, "test": num_test}
        self.num_distractors, self.max_distractors = num_distractors, max_distractors
        self.facts_per_passage, self.max_value_words = facts_per_passage, max_value_words
        self.noise_rate, self.noise_in_inputs = noise_rate, noise_in_inputs
        self.data_seed, self.seed = data_seed, seed
        self.batch_size, self.eval_batch_size, self.num_workers = (
            batch_size,
            eval_batch_size,
            num_workers,
        )
        self.words = build_vocabulary(num_entities)
        self.entities = entity_names(num_entities)
        self.tokenizer = word_tokenizer(self.words)
        self.ids = {w: i for i, w in enumerate(self.words)}
        self.worlds: dict[str, list[SyntheticWorld]] = {}
        self.encoded: dict[str, list[SyntheticQAExample]] = {}

    # ----------------------------------------------------------- generation
    def load_tokenizer(self) -> TextTokenizer:
        return self.tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    def generate(self, split: str) -> list[SyntheticWorld]:
        """The split's questions; each from ``data_seed``, the split and its index alone."""
        if split not in self.worlds:
            salt = {"train": 0, "val": 1, "test": 2, "pretrain": 3}[split]
            n = self.num.get(split, 0)
            self.worlds[split] = [
                generate_world(
                    _rng(self.data_seed, salt, i),
                    f"{split}-{i}",
                    self.entities,
                    self.facts_per_passage,
                    self.max_distractors,
                    self.max_value_words,
                )
                for i in range(n)
            ]
        return self.worlds[split]

    def encode(self, world: SyntheticWorld, k: int) -> SyntheticQAExample:
        """BOS, passages joined by ``|``, the question, ``Answer :``; the answer and EOS."""
        passages, pos = world.passages(k)
        words: list[str] = []
        gold_span = answer_span = (0, 0)
        for n, facts in enumerate(passages):
            if n:
                words.append("|")
            start = len(words)
            for f in facts:
                if n == pos and f.relation == world.relation:
                    a = len(words) + 2  # "e r" precedes the value
                    answer_span = (a + 1, a + 1 + len(f.value))  # +1: BOS
                words += f.words(self.fact_order)
            if n == pos:
                gold_span = (start + 1, len(words) + 1)
        words += world.question_words() + ["Answer", ":"]
        prompt = [self.ids[BOS]] + [self.ids[w] for w in words]
        answer = [self.ids[w] for w in world.answer] + [self.tokenizer.eos_id]
        return SyntheticQAExample(
            world.id,
            prompt,
            answer,
            list(answer),
            [" ".join(world.answer)],
            len(passages),
            len(passages) - 1,
            [pos],
            gold_span=gold_span,
            answer_span=answer_span,
        )

    def corrupt(self, examples: list[SyntheticQAExample]) -> None:
        """Corrupt exactly ``round(noise_rate * N)`` of the N answer tokens (not the EOS)."""
        slots = [(i, j) for i, ex in enumerate(examples) for j in range(len(ex.answer) - 1)]
        n = int(round(self.noise_rate * len(slots)))
        if n == 0:
            return
        rng = _rng(self.seed, 23, self.data_seed)
        special = {self.ids[w] for w in SPECIALS}
        choices = [i for i in range(len(self.words)) if i not in special]
        for s in sorted(rng.sample(range(len(slots)), n)):
            i, j = slots[s]
            ex = examples[i]
            while True:
                new = rng.choice(choices)
                if new != ex.answer[j]:
                    break
            ex.labels[j] = new
            ex.corrupted.append(j)
            if self.noise_in_inputs:  # the answer read by teacher forcing is the noisy one
                ex.answer[j] = new

    def setup(self, stage: str | None = None) -> None:
        if self.encoded:
            return
        for split in ("train", "val", "test"):
            out = [self.encode(w, self.num_distractors) for w in self.generate(split)]
            if split == "train":
                self.corrupt(out)
            for i, ex in enumerate(out):
                ex.index = i
            self.encoded[split] = out

    @property
    def corrupted_fraction(self) -> float:
        """The fraction of training answer tokens (EOS excluded) whose label is corrupted."""
        train = self.encoded["train"]
        total = sum(len(e.answer) - 1 for e in train)
        return sum(len(e.corrupted) for e in train) / max(total, 1)

    # ---------------------------------------------------------- loaders
    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return DataLoader(
            self.encoded[split],  # type: ignore[arg-type]
            batch_size=self.batch_size if shuffle else self.eval_batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=collate_synthetic,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)

    def save_tokenizer(self, path: str | Path) -> None:
        self.tokenizer.save(path)


def collate_synthetic(items: Sequence[SyntheticQAExample]) -> dict[str, Any]:
    """:func:`collate_qa` (pad id 0) plus ``label_corrupted`` (B, T): True where the
    target of position ``t`` is a corrupted label."""
    batch = collate_qa(items, 0)
    mask = torch.zeros_like(batch["labels"], dtype=torch.bool)
    for i, it in enumerate(items):
        m = len(it.prompt)
        for j in it.corrupted:
            mask[i, m - 1 + j] = True
    batch["label_corrupted"] = mask
    return batch


class SyntheticQAPretrainDataModule(SyntheticQADataModule):
    """Plain-text pretraining on the task's passages (no question template, no SFT data).

    Each document is 1 to ``1 + max_distractors`` passages of a generated world
    (uniformly many, in a random order, joined by ``|``) followed by
    ``recall_per_document`` facts of the document restated as
    ``recall <entity> <relation> <value> .``
    (self-supervised from the passages; it teaches reading a fact back from the
    context, in a template other than the question's). Worlds are drawn apart
    from the SFT splits (their own salt), ``num_documents`` of them for
    training and ``num_documents // 20`` for validation, the loss on every token.

    ``copy_passages``: after the recall lines, that many of the document's
    passages restated word for word (``recall | <passage>``): every value in them
    is predictable only from the entity and relation before it, the lookup a
    question needs, with a target at every fact.

    ``packing``: ``"documents"`` (default) packs whole documents into rows of
    ``seq_len`` tokens (right-padded, the padding out of the loss), so a recall
    line always has its passages in context; ``"stream"`` concatenates the
    documents and cuts every ``seq_len`` tokens, across document boundaries.
    A document longer than ``seq_len`` is cut either way (nothing is dropped).
    """

    def __init__(
        self,
        num_documents: int = 20000,
        recall_per_document: int = 2,
        seq_len: int = 128,
        packing: str = "documents",
        copy_passages: int = 0,
        **kwargs: Any,
    ) -> None:
        if packing not in ("documents", "stream"):
            raise ValueError(f"packing must be 'documents' or 'stream', got {packing!r}")
        check_int("num_documents", num_documents)
        check_int("copy_passages", copy_passages, low=0)
        check_int("recall_per_document", recall_per_document, low=0)
        check_int("seq_len", seq_len, low=2)
        super().__init__(**kwargs)
        self.num_documents, self.recall, self.seq_len = num_documents, recall_per_document, seq_len
        self.packing, self.copy_passages = packing, copy_passages
        self.chunks: dict[str, list[list[int]]] = {}

    def document(self, rng: random.Random, qid: str) -> list[int]:
        w = generate_world(
            rng,
            qid,
            self.entities,
            self.facts_per_passage,
            self.max_distractors,
            self.max_value_words,
        )
        passages = [w.gold, *w.distractors][: rng.randint(1, 1 + self.max_distractors)]
        words: list[str] = []
        for n, p in enumerate(rng.sample(passages, len(passages))):
            words += (["|"] if n else []) + [x for f in p for x in f.words(self.fact_order)]
        facts = [f for p in passages for f in p]
        for f in rng.sample(facts, min(self.recall, len(facts))):
            words += ["recall", *f.words(self.fact_order)]
        for p in rng.sample(passages, min(self.copy_passages, len(passages))):
            words += ["recall", "|", *(x for f in p for x in f.words(self.fact_order))]
        return [self.tokenizer.eos_id] + [self.ids[x] for x in words]

    def setup(self, stage: str | None = None) -> None:
        if self.chunks:
            return
        for split, n, salt in (
            ("train", self.num_documents, 3),
            ("val", self.num_documents // 20, 4),
        ):
            docs = [
                self.document(_rng(self.data_seed, salt, i), f"doc-{i}") for i in range(max(n, 1))
            ]
            if self.packing == "documents":
                self.chunks[split] = document_rows(docs, self.seq_len)
            else:
                self.chunks[split] = text_chunks([t for d in docs for t in d], self.seq_len)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return DataLoader(
            self.chunks[split],  # type: ignore[arg-type]
            batch_size=self.batch_size if shuffle else self.eval_batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=self._collate_rows if self.packing == "documents" else collate_text,
        )

    def _collate_rows(self, rows: Sequence[Sequence[int]]) -> dict[str, Any]:
        return collate_rows(rows, self.ids[PAD])

    def test_dataloader(self) -> DataLoader:
        raise NotImplementedError("the pretraining stage has no test split")


def describe(dm: SyntheticQADataModule) -> str:
    """A one-line JSON of the generator's settings (for results files)."""
    keys = (
        "num_distractors",
        "facts_per_passage",
        "max_value_words",
        "noise_rate",
        "noise_in_inputs",
        "fact_order",
        "data_seed",
        "seed",
    )
    return json.dumps({k: getattr(dm, k) for k in keys} | {"vocab": len(dm.words), **dm.num})
