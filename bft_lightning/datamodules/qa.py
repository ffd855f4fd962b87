"""Question answering data for supervised fine-tuning of a causal LM.

Readers (one ``QAExample`` per question):

- SQuAD JSON, v1.1 and v2.0 (unanswerable questions have ``answers == []``;
  their target is the empty answer, i.e. EOS right away, which is what the
  v2.0 metric rewards);
- HotpotQA distractor JSONL, in the IRCoT layout and the original layout
  (2 gold paragraphs plus the dataset's own distractors);
- NQ-open with its gold passage (``*.jsonl.gz``, the *Lost in the Middle* oracle file);
- RGB ``en_fact.json`` (positive snippets are gold, negatives are the distractors).

Splits are by ``group`` and never by question: the SQuAD article title (so no
context is shared across splits), the NQ gold-passage title, the HotpotQA /
RGB question id.

A training sequence is ``BOS passages "\\n\\nQuestion: q\\nAnswer:" " answer" EOS``
and the loss is on the answer tokens (and the EOS) only. When it is too long,
distractors go first, then gold passages are cropped, the answer-bearing one
to a window around the answer, so the answer is never cut out of its gold
passage (an example whose answer cannot fit is dropped, counted and reported;
a split left empty is an error).

Noise:

- label corruption (``noise_rate`` = ``np``): each answer label token (not the
  EOS) of a *training* example is replaced, with probability ``np``, by a token
  drawn uniformly from the non-special vocabulary minus the original token;
  the draw is fixed per example by ``seed`` and the question id alone (a fixed
  noisy dataset, the same whatever the distractors or the subset), inputs
  stay clean (teacher forcing reads the clean answer);
- distractors (``num_distractors`` = ``k``): ``k`` passages from other groups
  of the same split (``"other_articles"``), other paragraphs of the same
  article (``"same_article"``) or the dataset's own (``"dataset"``); the gold
  passages are inserted at random positions among them (seeded per example).

The data root is ``$BFT_DATA_ROOT``, by default ``<repo>/../shared/data``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from bft_lightning.datamodules.cache import file_sha256
from bft_lightning.models.checkpoint import TextTokenizer, load_tokenizer
from bft_lightning.nn.checks import check_int, check_number, check_sizes

REPO_ROOT = Path(__file__).resolve().parents[2]
DATASETS: dict[str, tuple[str, ...]] = {
    "squad": ("squad-dev/dev-v1.1.json",),
    "squad2": ("squad-dev/dev-v2.0.json",),
    "hotpotqa": (
        "hotpotqa-distractor/hotpot_dev_distractor_ircot_subsampled500.jsonl",
        "hotpotqa-distractor/hotpot_dev_distractor_reflexion_sample100.jsonl",
    ),
    "nq": ("nq-open-oracle/nq-open-oracle.jsonl.gz",),
    "rgb": ("rgb-en-fact/en_fact.json",),
}
DISTRACTOR_SOURCES = ("auto", "other_articles", "same_article", "dataset")
PASSAGE_SEP = "\n\n"
QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"
IGNORE_INDEX = -100


def data_root(root: str | Path | None = None) -> Path:
    """``root`` when given, else ``$BFT_DATA_ROOT``, else ``<repo>/../shared/data``."""
    if root is not None:
        return Path(root).expanduser()
    return Path(os.environ.get("BFT_DATA_ROOT", REPO_ROOT.parent / "shared" / "data"))


def resolve_data_file(path: str | Path, root: str | Path | None = None) -> Path:
    """``path`` if it exists, else under the data root (e.g. ``tinyshakespeare/input.txt``)."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return p
    return data_root(root) / p


@dataclass
class Passage:
    text: str
    title: str = ""
    gold: bool = True


@dataclass
class QAExample:
    """One question: gold passages first (``gold=True``), then the dataset's distractors."""

    id: str
    question: str
    answers: list[str]
    passages: list[Passage]
    group: str
    answer_start: int | None = None  # char offset of answers[0] in the first gold passage

    @property
    def gold(self) -> list[Passage]:
        return [p for p in self.passages if p.gold]

    @property
    def distractors(self) -> list[Passage]:
        return [p for p in self.passages if not p.gold]


# ----------------------------------------------------------------- readers
@contextmanager
def _fields(where: str) -> Iterator[None]:
    """Turn a missing or malformed field into a ValueError naming ``where`` (file and line)."""
    try:
        yield
    except KeyError as err:
        raise ValueError(f"{where}: missing field {err.args[0]!r}") from None
    except (TypeError, IndexError, AttributeError) as err:
        raise ValueError(f"{where}: malformed row: {err}") from err


def read_squad(path: str | Path) -> list[QAExample]:
    """SQuAD v1.1 / v2.0 JSON; group = article title."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
    out = []
    with _fields(f"{path}: top level"):
        articles = data["data"]
    for ai, article in enumerate(articles):
        with _fields(f"{path}: data[{ai}]"):
            title = article["title"]
            paragraphs = article["paragraphs"]
        for pi, para in enumerate(paragraphs):
            with _fields(f"{path}: data[{ai}].paragraphs[{pi}]"):
                ctx = para["context"]
                qas = para["qas"]
            for qi, qa in enumerate(qas):
                with _fields(f"{path}: data[{ai}].paragraphs[{pi}].qas[{qi}]"):
                    answers = [a["text"] for a in qa.get("answers", [])]
                    if qa.get("is_impossible"):
                        answers = []
                    start = qa["answers"][0]["answer_start"] if answers else None
                    ex = QAExample(
                        qa["id"], qa["question"], answers, [Passage(ctx, title)], title, start
                    )
                out.append(ex)
    return out


def _jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """Non-blank rows, each with its ``file:line`` (1-based, blank lines counted)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON: {err.msg} (column {err.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def read_hotpotqa(path: str | Path) -> list[QAExample]:
    """HotpotQA distractor JSONL (IRCoT layout or the original layout); group = question id."""
    out = []
    for where, row in _jsonl(Path(path)):
        with _fields(where):
            if "contexts" in row:  # IRCoT
                answers = [s for a in row["answers_objects"] for s in a["spans"]]
                passages = [
                    Passage(c["paragraph_text"], c["title"], bool(c["is_supporting"]))
                    for c in row["contexts"]
                ]
                qid, question = row["question_id"], row["question_text"]
            else:
                gold_titles = {t for t, _ in row["supporting_facts"]}
                passages = [Passage("".join(s), t, t in gold_titles) for t, s in row["context"]]
                qid, question, answers = row["_id"], row["question"], [row["answer"]]
        passages.sort(key=lambda p: not p.gold)  # gold first, order otherwise kept
        out.append(QAExample(qid, question, answers, passages, qid))
    return out


def read_nq_open(path: str | Path) -> list[QAExample]:
    """NQ-open oracle (one gold passage); group = the gold passage's Wikipedia title.

    The file has no question ids: ids are ``nq-<file stem>-<row>``, so rows of
    two files never collide (``read_dataset`` drops repeated ids).
    """
    path = Path(path)
    stem = path.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix(".json")
    out = []
    for i, (where, row) in enumerate(_jsonl(path)):
        with _fields(where):
            ctx = row["ctxs"][0]
            p = Passage(ctx["text"], ctx.get("title", ""))
            ex = QAExample(f"nq-{stem}-{i}", row["question"], list(row["answers"]), [p], p.title)
        out.append(ex)
    return out


def read_rgb(path: str | Path) -> list[QAExample]:
    """RGB (``en_fact.json``): positives are gold, negatives distractors; group = id."""
    out = []
    for where, row in _jsonl(Path(path)):
        with _fields(where):
            ans = row["answer"]
            answers = [ans] if isinstance(ans, str) else [a for x in ans for a in _flat(x)]
            passages = [Passage(t) for t in row["positive"]]
            passages += [Passage(t, gold=False) for t in row.get("negative", [])]
            ex = QAExample(f"rgb-{row['id']}", row["query"], answers, passages, str(row["id"]))
        out.append(ex)
    return out


def _flat(x: Any) -> list[str]:
    return [x] if isinstance(x, str) else [a for y in x for a in _flat(y)]


def read_qa(path: str | Path) -> list[QAExample]:
    """Read any supported file by its name and content."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"QA file {str(path.absolute())!r} not found; set data_root (or $BFT_DATA_ROOT) to "
            "the folder that holds the datasets' folders"
        )
    if path.suffix == ".gz":
        return read_nq_open(path)
    with open(path, encoding="utf-8") as f:
        line = f.readline()
    try:
        first = json.loads(line)
    except json.JSONDecodeError:  # pretty-printed JSON: SQuAD layout
        return read_squad(path)
    if not isinstance(first, dict) or "data" in first:
        return read_squad(path)
    if "query" in first and "positive" in first:
        return read_rgb(path)
    if "contexts" in first or "supporting_facts" in first:
        return read_hotpotqa(path)
    if "ctxs" in first:
        return read_nq_open(path)
    raise ValueError(f"{str(path)!r}: not SQuAD, HotpotQA, NQ-open or RGB")


def read_dataset(files: Sequence[str | Path]) -> list[QAExample]:
    """Read and concatenate files, keeping the first of each question id.

    A repeated id with the same question and answers is a duplicate (HotpotQA's
    two files share 12 questions): it is dropped, with a warning that counts
    them. A repeated id with another question or answers is an error, since
    dropping it would lose a question.
    """
    first: dict[str, tuple[Path, QAExample]] = {}
    dropped: Counter[Path] = Counter()
    out = []
    for file in map(Path, files):
        for ex in read_qa(file):
            if ex.id not in first:
                first[ex.id] = (file, ex)
                out.append(ex)
                continue
            other_file, other = first[ex.id]
            if (ex.question, ex.answers) != (other.question, other.answers):
                raise ValueError(
                    f"question id {ex.id!r} is in {str(other_file)!r} and {str(file)!r} "
                    f"with different questions or answers ({other.question!r}, {ex.question!r})"
                )
            dropped[file] += 1
    if dropped:
        counts = ", ".join(f"{n} from {str(f)!r}" for f, n in dropped.items())
        warnings.warn(
            f"dropped {sum(dropped.values())} duplicate questions (same id, question and "
            f"answers as an earlier one): {counts}",
            stacklevel=2,
        )
    return out


def split_by_group(
    examples: Sequence[QAExample], n_val: int | float, n_test: int | float, seed: int = 0
) -> tuple[list[QAExample], list[QAExample], list[QAExample]]:
    """Train / val / test by group (article): ``n_*`` groups, or a fraction of groups."""
    groups = sorted({ex.group for ex in examples})
    order = np.random.default_rng(seed).permutation(len(groups))
    n = len(groups)
    k_val = int(round(n_val * n)) if isinstance(n_val, float) else n_val
    k_test = int(round(n_test * n)) if isinstance(n_test, float) else n_test
    if k_val + k_test >= n:
        raise ValueError(f"{k_val} val + {k_test} test groups leave no training group of {n}")
    test = {groups[i] for i in order[:k_test]}
    val = {groups[i] for i in order[k_test : k_test + k_val]}
    parts: tuple[list[QAExample], list[QAExample], list[QAExample]] = ([], [], [])
    for ex in examples:
        parts[2 if ex.group in test else 1 if ex.group in val else 0].append(ex)
    return parts


# ----------------------------------------------------------- tokenisation
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

    The first of ``ex.answers`` found in a gold passage (on NQ-open ~8% of the
    questions list first an answer that their passage does not contain, while
    another listed answer is there: training on the first would teach an answer
    the prompt does not show, and the crop would not keep the one it does);
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


# --------------------------------------------------------------- batching
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
            else ``../shared/data`` next to the repository.
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


# ------------------------------------------------------ plain-text stage
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


def text_chunks(ids: Sequence[int], length: int) -> list[list[int]]:
    """Non-overlapping chunks of ``length + 1`` tokens (inputs plus shifted targets)."""
    n = (len(ids) - 1) // length
    return [list(ids[i * length : i * length + length + 1]) for i in range(n)]


def collate_text(chunks: Sequence[Sequence[int]]) -> dict[str, Tensor]:
    x = torch.tensor([list(c) for c in chunks], dtype=torch.long)
    return {
        "input_ids": x[:, :-1],
        "attention_mask": torch.ones_like(x[:, :-1]),
        "labels": x[:, 1:],
    }


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
