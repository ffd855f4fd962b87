"""Readers, one per dataset family, each to a list of ``QAExample``: SQuAD JSON (v1.1 and
v2.0), HotpotQA distractor JSONL, NQ-open, RGB; ``read_qa`` picks one by a file's content,
``read_dataset`` concatenates files, ``split_by_group`` splits by article / group."""

from __future__ import annotations

import gzip
import json
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .examples import Passage, QAExample


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
