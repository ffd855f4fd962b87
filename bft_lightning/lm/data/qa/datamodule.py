"""``QADataModule``: QA for supervised fine-tuning, from files to loaders (read, split by
group, tokenizer, distractors, crop, label noise)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from bft_lightning.datamodules.cache import file_sha256
from bft_lightning.lm.llama_format import TextTokenizer, load_tokenizer
from bft_lightning.nn.checks import check_int, check_number, check_sizes

from .batching import _Collate
from .encoding import EncodedExample, encode_example, target_answer, train_bpe_tokenizer
from .examples import DATASETS, QAExample, data_root, resolve_data_file
from .noise import DISTRACTOR_SOURCES, arrange_passages, corrupt_labels, passage_pool
from .readers import read_dataset, split_by_group


def _hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class QADataModule(L.LightningDataModule):
    """QA for SFT: SQuAD (v1.1/v2.0), HotpotQA, NQ-open, RGB; noise and distractors.

    Args:
        dataset: ``squad``, ``squad2``, ``hotpotqa``, ``nq`` or ``rgb`` (files
            under the data root), ignored when ``files`` is given.
        files: explicit QA files (any supported format); a relative path that
            does not exist is read from the data root.
        tokenizer_path: a ``tokenizer.json`` (or a checkpoint directory holding
            one). None trains a byte-level BPE of ``tokenizer_vocab_size`` on the
            training split (plus ``extra_text_files``), cached in ``cache_dir``.
        tokenizer_vocab_size: vocabulary of a tokenizer trained here.
        extra_text_files: plain text that a trained tokenizer also learns from
            (relative paths as for ``files``).
        cache_dir: where a trained tokenizer is kept (not the repository).
        max_length: longest training sequence (prompt + answer + EOS).
        max_answer_tokens: training examples with longer answers are dropped.
        max_passage_tokens: every passage is first cut to this many tokens
            (the answer-bearing one to a window around the answer); None: no cap.
        num_distractors: ``k`` distractor passages per question.
        distractor_source: ``auto`` (the dataset's own if any, else other
            articles), ``other_articles``, ``same_article`` or ``dataset``.
        noise_rate: ``np``, the label-corruption rate of the training split.
        seed: seed of the noise and of the distractor draws.
        split_seed: seed of the split by group (keep it fixed across seeds).
        val_groups, test_groups: groups (articles) held out, a count or a fraction.
        max_train_examples, max_eval_examples: seeded subsets (None = all).
        batch_size, eval_batch_size, num_workers: loaders.
        data_root: the folder holding the datasets' folders; None: ``$BFT_DATA_ROOT``,
            else ``data`` under the working directory.
    """

    def __init__(
        self,
        dataset: str = "squad",
        files: list[str] | None = None,
        tokenizer_path: str | None = None,
        tokenizer_vocab_size: int = 1024,
        extra_text_files: list[str] | None = None,
        cache_dir: str | None = None,
        max_length: int = 512,
        max_answer_tokens: int = 32,
        max_passage_tokens: int | None = None,
        num_distractors: int = 0,
        distractor_source: str = "auto",
        noise_rate: float = 0.0,
        seed: int = 0,
        split_seed: int = 0,
        val_groups: int | float = 4,
        test_groups: int | float = 10,
        max_train_examples: int | None = None,
        max_eval_examples: int | None = None,
        batch_size: int = 8,
        eval_batch_size: int = 16,
        num_workers: int = 0,
        data_root: str | None = None,
    ) -> None:
        super().__init__()
        if files is None and dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {dataset!r}")
        if distractor_source not in DISTRACTOR_SOURCES:
            raise ValueError(
                f"distractor_source must be one of {DISTRACTOR_SOURCES}, got {distractor_source!r}"
            )
        check_number("noise_rate", noise_rate, 0.0, 1.0)
        check_sizes(tokenizer_vocab_size=tokenizer_vocab_size, max_length=max_length,
                    batch_size=batch_size, eval_batch_size=eval_batch_size)  # fmt: skip
        check_int("max_answer_tokens", max_answer_tokens, low=0)  # 0: every answer left out
        for name, cap in (("max_passage_tokens", max_passage_tokens),
                          ("max_train_examples", max_train_examples),
                          ("max_eval_examples", max_eval_examples)):  # fmt: skip
            check_int(name, cap, optional=True)
        for name, count in (("num_distractors", num_distractors), ("num_workers", num_workers),
                            ("seed", seed), ("split_seed", split_seed)):  # fmt: skip
            check_int(name, count, low=0)
        for name, held in (("val_groups", val_groups), ("test_groups", test_groups)):
            if isinstance(held, float):
                check_number(name, held, 0.0, 1.0, high_open=True)
            else:
                check_int(name, held, low=0)
        self.save_hyperparameters()
        self.dataset, self.files, self.data_root = dataset, files, data_root
        self.tokenizer_path, self.tokenizer_vocab_size = tokenizer_path, tokenizer_vocab_size
        self.extra_text_files = [
            str(resolve_data_file(f, data_root)) for f in extra_text_files or []
        ]
        self.cache_dir = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "bft_lightning"
        self.max_length, self.max_answer_tokens = max_length, max_answer_tokens
        self.max_passage_tokens = max_passage_tokens
        self.num_distractors, self.distractor_source = num_distractors, distractor_source
        self.noise_rate, self.seed, self.split_seed = noise_rate, seed, split_seed
        self.val_groups, self.test_groups = val_groups, test_groups
        self.max_train_examples, self.max_eval_examples = max_train_examples, max_eval_examples
        self.batch_size, self.eval_batch_size, self.num_workers = (
            batch_size, eval_batch_size, num_workers,
        )  # fmt: skip
        self.tokenizer: TextTokenizer | None = None
        self.splits: dict[str, list[QAExample]] = {}
        self.encoded: dict[str, list[EncodedExample]] = {}
        self.dropped: dict[str, int] = {}
        self.short_of_distractors: dict[str, int] = {}  # examples with < num_distractors

    # ----------------------------------------------------------- set-up
    def source_files(self) -> list[Path]:
        if self.files is not None:
            return [resolve_data_file(f, self.data_root) for f in self.files]
        return [data_root(self.data_root) / f for f in DATASETS[self.dataset]]

    def load_splits(self) -> dict[str, list[QAExample]]:
        if not self.splits:
            examples = read_dataset(self.source_files())
            train, val, test = split_by_group(
                examples, self.val_groups, self.test_groups, self.split_seed
            )
            self.splits = {"train": train, "val": val, "test": test}
        return self.splits

    def load_tokenizer(self) -> TextTokenizer:
        """Load ``tokenizer_path``, or train (and cache) a BPE on the training split."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.tokenizer_path is not None:
            self.tokenizer = load_tokenizer(self.tokenizer_path)
            return self.tokenizer
        splits = self.load_splits()
        files = [str(f) for f in self.source_files()] + list(self.extra_text_files)
        contents = [file_sha256(f) for f in files]  # an edited file gets a new tokenizer
        key = _hash(files, contents, self.tokenizer_vocab_size, self.split_seed, self.val_groups,
                    self.test_groups)  # fmt: skip
        path = self.cache_dir / f"tokenizer-{key}.json"
        if path.is_file():
            try:
                self.tokenizer = load_tokenizer(path)
                return self.tokenizer
            except Exception as err:  # a damaged cache is rebuilt, never trusted
                rank_zero_warn(f"rebuilding unreadable tokenizer cache {str(path)!r}: {err}")
        self.tokenizer = train_bpe_tokenizer(
            self.training_texts(splits["train"]), self.tokenizer_vocab_size, path
        )
        return self.tokenizer

    def training_texts(self, train: Sequence[QAExample]) -> Iterator[str]:
        """Text a tokenizer learns from: training passages, questions, answers, extra files."""
        for _, p in passage_pool(train):
            yield p.text
        for ex in train:
            yield ex.question + " " + " ".join(ex.answers)
        for file in self.extra_text_files:
            yield Path(file).read_text(encoding="utf-8")

    @property
    def vocab_size(self) -> int:
        return self.load_tokenizer().vocab_size

    def setup(self, stage: str | None = None) -> None:
        """Encode every split; logs the kept and dropped counts, raises if a split empties."""
        if self.encoded:
            return
        tok = self.load_tokenizer()
        encoded = {}
        for name, examples in self.load_splits().items():
            encoded[name] = self.encode_split(name, examples, tok)
        counts = ", ".join(
            f"{n} {len(e)} kept, {self.dropped[n]} dropped" for n, e in encoded.items()
        )
        report = rank_zero_warn if any(self.dropped.values()) else rank_zero_info
        report(
            f"QADataModule examples: {counts} (dropped: the answer did not fit "
            f"max_answer_tokens={self.max_answer_tokens} (train only), "
            f"max_length={self.max_length} or max_passage_tokens={self.max_passage_tokens})"
        )
        self.encoded = encoded  # only once every split is complete

    def _subset(self, examples: list[QAExample], n: int | None, salt: int) -> list[QAExample]:
        if n is None or n >= len(examples):
            return examples
        idx = np.sort(np.random.default_rng([self.split_seed, salt]).permutation(len(examples))[:n])
        return [examples[i] for i in idx]

    def _example_rng(self, example_id: str, stream: int) -> np.random.Generator:
        """A random stream of one example from ``seed``, its id and the stream's number.

        Not from the example's position: an example keeps its distractors,
        crop and corrupted labels whatever ``max_train_examples`` keeps beside
        it. The label noise (stream 23) is apart from the distractor and
        cropping draws, so it does not move with ``num_distractors`` either.
        """
        digest = int(hashlib.sha256(example_id.encode("utf-8")).hexdigest()[:16], 16)
        return np.random.default_rng([self.seed, stream, digest])

    def _noise_rng(self, example_id: str) -> np.random.Generator:
        """The label-noise stream of one example (see :meth:`_example_rng`)."""
        return self._example_rng(example_id, 23)

    def encode_split(
        self, name: str, examples: list[QAExample], tok: TextTokenizer
    ) -> list[EncodedExample]:
        """Encode a split (training labels noised); ValueError if every example is dropped."""
        train = name == "train"
        limit = self.max_train_examples if train else self.max_eval_examples
        examples = self._subset(examples, limit, {"train": 0, "val": 1, "test": 2}[name])
        pool = passage_pool(self.splits[name])
        special = {i for i in (tok.bos_id, tok.eos_id, tok.pad_id) if i is not None}
        out, dropped, too_long_answer, short = [], 0, 0, 0
        max_answer = self.max_answer_tokens if train else 10**6
        salt = {"train": 11, "val": 12, "test": 13}[name]
        for ex in examples:
            rng = self._example_rng(ex.id, salt)
            passages = arrange_passages(ex, self.num_distractors, self.distractor_source, pool, rng)
            short += len(passages) - len(ex.gold) < self.num_distractors
            # eval answers are never dropped for length: their targets only feed the val loss
            enc = encode_example(
                ex, tok, passages, self.max_length, max_answer, self.max_passage_tokens, rng,
            )  # fmt: skip
            if enc is None:
                dropped += 1
                answer = target_answer(ex)[0]
                too_long_answer += answer != "" and len(tok.encode(" " + answer)) > max_answer
                continue
            if train and self.noise_rate > 0:
                enc.labels = corrupt_labels(
                    enc.answer, self.noise_rate, tok.vocab_size, special, self._noise_rng(ex.id)
                )
            out.append(enc)
        for i, enc in enumerate(out):
            enc.index = i
        self.dropped[name] = dropped
        self.short_of_distractors[name] = short
        if short:
            rank_zero_warn(
                f"QADataModule {name}: {short} of {len(examples)} examples got fewer than "
                f"num_distractors={self.num_distractors} distractors: their source "
                f"({self.distractor_source!r}) has fewer candidates (a drawn passage that "
                "contains an accepted answer is not one)"
            )
        if examples and not out:
            causes = []
            if too_long_answer:
                causes.append(
                    f"{too_long_answer} with answers longer than max_answer_tokens={max_answer}"
                )
            if dropped > too_long_answer:
                causes.append(
                    f"{dropped - too_long_answer} whose answer does not fit max_length="
                    f"{self.max_length} with max_passage_tokens={self.max_passage_tokens}"
                )
            raise ValueError(f"all {dropped} {name} examples were dropped: " + "; ".join(causes))
        return out

    # ---------------------------------------------------------- loaders
    def _loader(self, name: str, shuffle: bool) -> DataLoader:
        tok = self.load_tokenizer()
        return DataLoader(
            self.encoded[name],  # type: ignore[arg-type]
            batch_size=self.batch_size if shuffle else self.eval_batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=_Collate(tok.pad_id),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)
