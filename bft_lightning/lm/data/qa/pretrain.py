"""The plain-text stage before SFT: ``QAPretrainDataModule`` (passages, text files and
self-supervised cloze questions, cut into chunks)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from bft_lightning.nn.checks import check_int, check_number

from .batching import collate_text, text_chunks
from .datamodule import QADataModule
from .encoding import encode_example
from .examples import Passage, QAExample
from .noise import passage_pool

_SENTENCE = re.compile(r"[^.!?]+[.!?]?")
_WORD = re.compile(r"\S+")


def cloze_examples(
    passages: Sequence[Passage], per_passage: int, rng: np.random.Generator
) -> list[QAExample]:
    """Self-supervised extraction questions from passages, no QA labels.

    The question is a sentence of the passage with a span of 1 to 4 words
    replaced by ``_``; the answer is that span (trailing punctuation dropped).
    Teaches a model trained from scratch to find and copy a span of its
    context (cf. span-selection pretraining, Glass et al. 2020).
    """
    out = []
    for i, p in enumerate(passages):
        sentences = [m for m in _SENTENCE.finditer(p.text) if len(m.group().split()) >= 6]
        for j in range(per_passage if sentences else 0):
            sent = sentences[int(rng.integers(len(sentences)))]
            words = list(_WORD.finditer(sent.group()))
            n = int(rng.integers(1, 5))
            first = int(rng.integers(1, len(words) - n + 1)) if len(words) > n + 1 else 1
            last = min(first + n, len(words)) - 1
            a0, a1 = sent.start() + words[first].start(), sent.start() + words[last].end()
            answer = p.text[a0:a1].rstrip(".,;:!?\"')")
            if not answer:
                continue
            text = sent.group()
            question = text[: words[first].start()] + "_" + text[words[last].end() :]
            out.append(QAExample(f"cloze-{i}-{j}", question.strip(), [answer], [p], "cloze", a0))
    return out


class QAPretrainDataModule(QADataModule):
    """Language-model pretraining text for a model trained from scratch.

    Train: the training split's passages plus the first ``train_fraction`` of
    each ``extra_text_files`` file; ``cloze_per_passage`` self-supervised
    extraction questions per training passage (:func:`cloze_examples`) in the
    SFT format; and with ``qa_pairs`` the training QA pairs (off by default: a
    later noisy-SFT comparison must not have seen the clean answers).
    Validation: the validation split's passages and the rest of the text
    files. Test articles are never read. Cut into chunks of ``seq_len``
    tokens; the loss is on every token.
    """

    def __init__(
        self, seq_len: int = 256, train_fraction: float = 0.9, qa_pairs: bool = False,
        cloze_per_passage: int = 0, **kwargs: Any,
    ) -> None:  # fmt: skip
        check_int("seq_len", seq_len, low=2)  # a chunk predicts its tokens after the first
        check_number("train_fraction", train_fraction, 0.0, 1.0, low_open=True)
        check_int("cloze_per_passage", cloze_per_passage, low=0)
        super().__init__(**kwargs)
        self.seq_len, self.train_fraction, self.qa_pairs = seq_len, train_fraction, qa_pairs
        self.cloze_per_passage = cloze_per_passage
        self.chunks: dict[str, list[list[int]]] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.chunks:
            return
        tok = self.load_tokenizer()
        splits = self.load_splits()
        for name in ("train", "val"):
            ids: list[int] = []
            for _, p in passage_pool(splits[name]):
                ids += [tok.eos_id] + tok.encode(p.text, start=True)  # a document each
            qa: list[QAExample] = []
            if name == "train" and self.cloze_per_passage:
                pool = [p for _, p in passage_pool(splits["train"])]
                qa += cloze_examples(pool, self.cloze_per_passage, np.random.default_rng(self.seed))
            if name == "train" and self.qa_pairs:
                qa += splits["train"]
            if qa:
                order = np.random.default_rng([self.seed, 5]).permutation(len(qa))
                skipped = 0
                for ex in (qa[i] for i in order):
                    enc = encode_example(
                        ex, tok, ex.gold, self.max_length, self.max_answer_tokens,
                        self.max_passage_tokens, np.random.default_rng([self.seed, 7, len(ids)]),
                    )  # fmt: skip
                    if enc is None:  # the answer does not fit: reported below, not silent
                        skipped += 1
                    else:
                        ids += enc.prompt + enc.answer
                if skipped:
                    rank_zero_warn(
                        f"pretraining text ({name}): {skipped} of {len(qa)} QA/cloze examples "
                        "left out, their answers do not fit (max_answer_tokens, max_length)"
                    )
            for file in self.extra_text_files:
                text = Path(file).read_text(encoding="utf-8")
                cut = int(len(text) * self.train_fraction)
                part = text[:cut] if name == "train" else text[cut:]
                ids += [tok.eos_id] + tok.encode(part, start=True)
            self.chunks[name] = text_chunks(ids, self.seq_len)

    def _text_loader(self, name: str, shuffle: bool) -> DataLoader:
        return DataLoader(
            self.chunks[name],  # type: ignore[arg-type]
            batch_size=self.batch_size if shuffle else self.eval_batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=collate_text,
        )

    def train_dataloader(self) -> DataLoader:
        return self._text_loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._text_loader("val", False)

    def test_dataloader(self) -> DataLoader:
        raise NotImplementedError("the pretraining stage has no test split; test on QADataModule")
