"""QA data on small hand-written files: reader errors, ids, drop reports, tokenizer cache, noise."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from bft_lightning.lm.data import qa
from bft_lightning.lm.data.qa import QADataModule, read_dataset, read_qa


def _hotpot(qid: str, question: str = "who", answer: str = "w1") -> dict:
    ctx = {"paragraph_text": f"{answer} is it", "title": "t", "is_supporting": True}
    return {
        "question_id": qid,
        "question_text": question,
        "answers_objects": [{"spans": [answer]}],
        "contexts": [ctx],
    }


def _nq(question: str) -> dict:
    return {"question": question, "answers": ["w1"], "ctxs": [{"text": "w1 w2", "title": "T"}]}


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def write_squad(path: Path, articles: int = 8, answer_words: tuple[int, ...] = (1,)) -> Path:
    """SQuAD v1.1 over words ``w4 .. w59``; question ``k`` has ``answer_words[k]`` words."""
    rng = random.Random(0)
    data = []
    for a in range(articles):
        paras = []
        for p in range(3):
            words = [f"w{rng.randrange(4, 60)}" for _ in range(30)]
            ctx = " ".join(words)
            qas = []
            for q, n in enumerate(answer_words):
                i = rng.randrange(1, len(words) - n)
                start = len(" ".join(words[:i])) + 1
                answer = " ".join(words[i : i + n])
                qas.append(
                    {
                        "id": f"a{a}p{p}q{q}",
                        "question": f"after {words[i - 1]}",
                        "answers": [{"text": answer, "answer_start": start}],
                    }
                )
            paras.append({"context": ctx, "qas": qas})
        data.append({"title": f"Article_{a}", "paragraphs": paras})
    path.write_text(json.dumps({"version": "1.1", "data": data}), encoding="utf-8")
    return path


def _dm(tmp_path: Path, file: Path, **kw: object) -> QADataModule:
    opts: dict = dict(files=[str(file)], cache_dir=str(tmp_path / "cache"),
                      tokenizer_vocab_size=300, val_groups=2, test_groups=2)  # fmt: skip
    return QADataModule(**{**opts, **kw})


# ----------------------------------------------------------- reader errors
def test_broken_jsonl_line_names_file_and_line(write: Callable[..., Path]) -> None:
    rows = _jsonl([_hotpot("a"), _hotpot("b")])
    path = write("h.jsonl", rows + "\n" + '{"question_id": "c",\n')  # line 4, after a blank
    with pytest.raises(ValueError, match=rf"^{path}:4: invalid JSON"):
        read_qa(path)
    nq = write("n.jsonl.gz", _jsonl([_nq("q0")]) + "not json\n", gz=True)
    with pytest.raises(ValueError, match=rf"^{nq}:2: invalid JSON"):
        read_qa(nq)


@pytest.mark.parametrize(
    ("name", "row", "field"),
    [
        ("h.jsonl", {k: v for k, v in _hotpot("b").items() if k != "answers_objects"},
         "answers_objects"),
        ("n.jsonl.gz", {"answers": ["x"], "ctxs": [{"text": "x"}]}, "question"),
        ("r.json", {"id": 2, "query": "q", "positive": ["p"]}, "answer"),
    ],
)  # fmt: skip
def test_missing_field_names_file_line_and_field(
    write: Callable[..., Path], name: str, row: dict, field: str
) -> None:
    first = {
        "h.jsonl": _hotpot("a"),
        "n.jsonl.gz": _nq("q0"),
        "r.json": {"id": 1, "query": "q", "answer": "a", "positive": ["p"]},
    }[name]
    path = write(name, _jsonl([first, row]), gz=name.endswith(".gz"))
    with pytest.raises(ValueError, match=rf"^{path}:2: missing field '{field}'"):
        read_qa(path)


def test_squad_missing_field_names_its_place(tmp_path: Path) -> None:
    path = write_squad(tmp_path / "s.json", articles=2, answer_words=(1, 1))
    doc = json.loads(path.read_text())
    del doc["data"][1]["paragraphs"][2]["qas"][1]["question"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"data\[1\]\.paragraphs\[2\]\.qas\[1\]: missing field"):
        read_qa(path)


# ------------------------------------------------------------ question ids
def test_two_nq_files_keep_every_question(write: Callable[..., Path]) -> None:
    a = write("a.jsonl.gz", _jsonl([_nq(f"a{i}") for i in range(3)]), gz=True)
    b = write("b.jsonl.gz", _jsonl([_nq(f"b{i}") for i in range(4)]), gz=True)
    examples = read_dataset([a, b])
    expected = [f"a{i}" for i in range(3)] + [f"b{i}" for i in range(4)]
    assert [e.question for e in examples] == expected
    assert len({e.id for e in examples}) == 7


def test_repeated_questions_are_reported_or_rejected(write: Callable[..., Path]) -> None:
    a = write("a.jsonl", _jsonl([_hotpot("x"), _hotpot("y")]))
    b = write("b.jsonl", _jsonl([_hotpot("y"), _hotpot("z")]))
    with pytest.warns(UserWarning, match=r"dropped 1 duplicate questions.*1 from .*b\.jsonl"):
        examples = read_dataset([a, b])
    assert [e.id for e in examples] == ["x", "y", "z"]
    c = write("c.jsonl", _jsonl([_hotpot("y", question="another question")]))
    with pytest.raises(ValueError, match=r"'y' is in .*a\.jsonl.* and .*c\.jsonl"):
        read_dataset([a, c])


# --------------------------------------------------------- dropped examples
def test_dropped_examples_are_reported(tmp_path: Path) -> None:
    file = write_squad(tmp_path / "s.json", answer_words=(1, 8))  # half the answers are long
    dm = _dm(tmp_path, file, max_answer_tokens=4)
    with pytest.warns(UserWarning, match=r"train (\d+) kept, \1 dropped.*max_answer_tokens=4"):
        dm.setup("fit")
    assert dm.dropped == {"train": len(dm.encoded["train"]), "val": 0, "test": 0}


def test_examples_short_of_distractors_are_reported(tmp_path: Path) -> None:
    """Three paragraphs per article: same-article distractors can give at most two."""
    file = write_squad(tmp_path / "s.json")
    dm = _dm(tmp_path, file, num_distractors=3, distractor_source="same_article")
    with pytest.warns(UserWarning, match=r"train: (\d+) of \1 examples got fewer than "):
        dm.setup("fit")
    assert dm.short_of_distractors["train"] == len(dm.encoded["train"]) > 0


def test_a_split_emptied_by_max_answer_tokens_is_an_error(tmp_path: Path) -> None:
    file = write_squad(tmp_path / "s.json", answer_words=(8,))
    dm = _dm(tmp_path, file, max_answer_tokens=1)
    with pytest.raises(ValueError, match=r"all \d+ train examples.*max_answer_tokens=1"):
        dm.setup("fit")
    assert dm.encoded == {}  # no half-set-up module left behind


# --------------------------------------------------------- tokenizer cache
def test_interrupted_tokenizer_save_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(src: object, dst: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(qa.encoding.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        qa.train_bpe_tokenizer(["w1 w2 w3"] * 10, 280, tmp_path / "tok" / "tokenizer.json")
    assert list((tmp_path / "tok").iterdir()) == []


def test_damaged_tokenizer_cache_is_rebuilt(tmp_path: Path) -> None:
    file = write_squad(tmp_path / "s.json")
    _dm(tmp_path, file).load_tokenizer()
    (cached,) = (tmp_path / "cache").glob("tokenizer-*.json")
    good = cached.read_text()
    cached.write_text(good[: len(good) // 2])  # as a write cut short would leave it
    with pytest.warns(UserWarning, match=rf"rebuilding unreadable tokenizer cache '{cached}'"):
        tok = _dm(tmp_path, file).load_tokenizer()
    assert tok.vocab_size == 300 and cached.read_text() == good


def test_edited_data_file_gets_a_new_tokenizer(tmp_path: Path) -> None:
    file = write_squad(tmp_path / "s.json", articles=8)
    _dm(tmp_path, file).load_tokenizer()
    write_squad(file, articles=9)  # same name, other content
    _dm(tmp_path, file).load_tokenizer()
    assert len(list((tmp_path / "cache").glob("tokenizer-*.json"))) == 2


# -------------------------------------------------------------- label noise
def test_label_noise_does_not_depend_on_distractors_or_subset(tmp_path: Path) -> None:
    file = write_squad(tmp_path / "s.json", articles=10, answer_words=(1, 2, 3))
    labels, corrupted = [], []
    for kw in ({}, {"num_distractors": 2}, {"max_train_examples": 40}):
        dm = _dm(tmp_path, file, noise_rate=0.5, seed=3, **kw)
        dm.setup("fit")
        assert all(e.labels == e.answer for e in dm.encoded["val"] + dm.encoded["test"])
        labels.append({e.id: e.labels for e in dm.encoded["train"]})
        corrupted.append(sum(e.labels != e.answer for e in dm.encoded["train"]))
    full, distracted, subset = labels
    assert corrupted[0] > len(full) // 4  # the noise is there to be compared
    assert distracted == full
    assert len(subset) == 40 and all(subset[i] == full[i] for i in subset)


def test_an_example_keeps_its_prompt_whatever_the_subset(tmp_path: Path) -> None:
    """Distractors and crops are drawn per example id, not per position: a smaller
    max_train_examples changes which examples are kept, not how a kept one reads."""
    file = write_squad(tmp_path / "s.json", articles=10, answer_words=(1, 2, 3))
    prompts = []
    for kw in ({}, {"max_train_examples": 40}):
        dm = _dm(tmp_path, file, num_distractors=2, max_passage_tokens=12, seed=5, **kw)
        dm.setup("fit")
        prompts.append({e.id: e.prompt for e in dm.encoded["train"]})
    full, subset = prompts
    assert len(subset) == 40 and all(subset[i] == full[i] for i in subset)


def test_batches_carry_each_question_s_position_in_its_split(tmp_path: Path) -> None:
    dm = _dm(tmp_path, write_squad(tmp_path / "s.json"), eval_batch_size=4)
    dm.setup("fit")
    seen = [i for b in dm.val_dataloader() for i in b["index"].tolist()]
    assert seen == list(range(len(dm.encoded["val"])))


def test_data_root_option_finds_a_named_dataset(tmp_path: Path) -> None:
    write_squad((tmp_path / "data" / "squad-dev").mkdir(parents=True) or
                tmp_path / "data" / "squad-dev" / "dev-v1.1.json")  # fmt: skip
    dm = QADataModule(dataset="squad", data_root=str(tmp_path / "data"),
                      cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=300,
                      val_groups=2, test_groups=2)  # fmt: skip
    dm.setup("fit")
    assert len(dm.encoded["train"]) > 0
    missing = QADataModule(dataset="squad", data_root=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"nowhere/squad-dev/dev-v1.1.json.*data_root"):
        missing.load_splits()
