"""QA data: readers on the real files, the split by article, truncation, noise, distractors."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from lm_helpers import write_squad_file

from bft_lightning.lm.data.qa import (
    DATASETS,
    IGNORE_INDEX,
    Passage,
    QADataModule,
    QAExample,
    arrange_passages,
    cloze_examples,
    collate_qa,
    corrupt_labels,
    crop_around,
    encode_example,
    passage_pool,
    read_dataset,
    split_by_group,
    train_bpe_tokenizer,
)
from bft_lightning.lm.data.qa import target_answer as qa_target_answer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory):
    texts = [f"w{i} w{(i * 7) % 60} the answer is {i} Question: Answer:" for i in range(300)]
    return train_bpe_tokenizer(texts, 320, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def files(data_root: Path, name: str) -> list[Path]:
    """The dataset's files; the test skips, naming the file, when one is absent."""
    paths = [data_root / f for f in DATASETS[name]]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        pytest.skip(f"{name}: {missing[0]} not found in the real-data folder")
    return paths


# ---------------------------------------------------------------- readers
def test_squad_readers_match_provenance_counts(data_root: Path) -> None:
    v1 = read_dataset(files(data_root, "squad"))
    assert len(v1) == 10570 and len({e.group for e in v1}) == 48
    assert all(e.answers and e.gold[0].text[e.answer_start :].startswith(e.answers[0]) for e in v1)
    v2 = read_dataset(files(data_root, "squad2"))
    assert len(v2) == 11873 and sum(not e.answers for e in v2) == 5945


def test_other_readers(data_root: Path) -> None:
    hot = read_dataset(files(data_root, "hotpotqa"))
    assert len(hot) == 588  # 500 + 100 with 12 shared ids
    assert all(len(e.gold) == 2 for e in hot if len(e.passages) == 10)
    assert sum(len(e.distractors) for e in hot) > 4000
    nq = read_dataset(files(data_root, "nq"))
    assert len(nq) == 2655 and all(len(e.passages) == 1 for e in nq)
    rgb = read_dataset(files(data_root, "rgb"))
    assert len(rgb) == 100 and all(e.distractors for e in rgb)


def test_split_is_by_article_and_stable(data_root: Path) -> None:
    ex = read_dataset(files(data_root, "squad"))
    train, val, test = split_by_group(ex, 4, 10, seed=0)
    groups = [{e.group for e in part} for part in (train, val, test)]
    assert [len(g) for g in groups] == [34, 4, 10]
    assert (
        not (groups[0] & groups[1]) and not (groups[0] & groups[2]) and not (groups[1] & groups[2])
    )
    assert len(train) + len(val) + len(test) == len(ex)
    again = split_by_group(ex, 4, 10, seed=0)[2]
    assert [e.id for e in again] == [e.id for e in test]


# ------------------------------------------------------------ truncation
def test_crop_keeps_the_answer_span() -> None:
    ids = list(range(100))
    rng = np.random.default_rng(0)
    starts = set()
    for _ in range(50):
        win, span = crop_around(ids, (40, 44), 10, rng)
        assert len(win) == 10 and all(i in win for i in range(40, 45))
        assert span is not None and win[span[0]] == 40 and win[span[1]] == 44
        starts.add(win[0])
    assert len(starts) > 3  # the answer's place in the window is random
    assert crop_around(ids, None, 10)[0] == list(range(10))
    with pytest.raises(ValueError):
        crop_around(ids, (10, 30), 10)


def _example(text: str, answer: str, distractors: int = 0) -> QAExample:
    ps = [Passage(text)] + [Passage(f"w{i} " * 40, gold=False) for i in range(distractors)]
    return QAExample("q", "what is it", [answer], ps, "g", text.find(answer))


def test_truncation_never_cuts_the_answer(bpe) -> None:
    rng = np.random.default_rng(0)
    for pos in (0, 50, 150, 199):
        words = [f"w{i % 60}" for i in range(200)]
        words[pos] = "answer"
        ex = _example(" ".join(words), "answer", distractors=3)
        enc = encode_example(ex, bpe, ex.passages, 64, 8, rng=rng)
        assert enc is not None and len(enc.prompt) + len(enc.answer) <= 64
        assert enc.n_distractors == 0  # distractors go first
        assert "answer" in bpe.decode(enc.prompt)
        enc = encode_example(ex, bpe, ex.passages, 64, 8, max_passage_tokens=20, rng=rng)
        assert enc is not None and "answer" in bpe.decode(enc.prompt)


def test_the_target_is_the_answer_the_passage_holds(bpe) -> None:
    """The first listed answer is not in the passage, the second is: the model trains
    on the second, and a tight crop keeps it in the prompt."""
    words = [f"w{i % 60}" for i in range(200)]
    words[150] = "answer"
    text = " ".join(words)
    ex = QAExample("q", "what is it", ["elsewhere", "answer"], [Passage(text)], "g", None)
    assert qa_target_answer(ex) == ("answer", ex.passages[0])
    rng = np.random.default_rng(0)
    for _ in range(5):
        enc = encode_example(ex, bpe, ex.passages, 64, 8, max_passage_tokens=12, rng=rng)
        assert enc is not None and bpe.decode(enc.answer[:-1]).strip() == "answer"
        assert "answer" in bpe.decode(enc.prompt) and enc.answers == ["elsewhere", "answer"]
    none_held = QAExample("q", "what", ["x1", "x2"], [Passage("w1 w2")], "g", None)
    assert qa_target_answer(none_held) == ("x1", None)


def test_drawn_distractors_never_hold_an_answer() -> None:
    """Passages of the split that contain an accepted answer (as a phrase, any case)
    are not drawn as distractors; a word merely containing it still may be."""
    ex = QAExample("q", "who", ["Blue Moon"], [Passage("gold: blue moon rises")], "a", None)
    pool = [
        ("b", Passage("it was a BLUE MOON night")),  # holds the answer
        ("c", Passage("the blue moonlight faded")),  # only a longer word: a fine distractor
        ("d", Passage("nothing here")),
    ]
    rng = np.random.default_rng(0)
    for _ in range(20):
        out = arrange_passages(ex, 3, "other_articles", pool, rng)
        texts = {p.text for p in out if not p.gold}
        assert texts == {"the blue moonlight faded", "nothing here"}  # 2 of the 3 asked


def test_answer_too_long_is_dropped(bpe) -> None:
    ex = _example("w1 w2 w3 w4 w5 w6 w7 w8", "w2 w3 w4 w5 w6 w7")
    assert encode_example(ex, bpe, ex.passages, 512, 2) is None
    assert encode_example(ex, bpe, ex.passages, 512, 32) is not None


def test_labels_cover_answer_tokens_only(bpe) -> None:
    ex = _example("w1 w2 w3 w4", "w3")
    enc = encode_example(ex, bpe, ex.passages, 512, 8)
    other = encode_example(_example("w5 w6", "w6"), bpe, [Passage("w5 w6")], 512, 8)
    assert enc is not None and other is not None
    batch = collate_qa([enc, other], bpe.pad_id)
    lab = batch["labels"][0]
    sel = lab != IGNORE_INDEX
    assert lab[sel].tolist() == enc.answer  # " w3" + EOS
    assert enc.answer[-1] == bpe.eos_id and bpe.decode(enc.answer[:-1]).strip() == "w3"
    # label t is the input token t + 1
    assert batch["input_ids"][0, 1:][sel[:-1]].tolist() == enc.answer[:-1]
    # prompts are left-padded and end with the question template
    assert batch["prompt_mask"][:, -1].all() and bpe.decode(enc.prompt).endswith("Answer:")


# ------------------------------------------------------------------ noise
def test_label_corruption_rate_and_properties() -> None:
    rng = np.random.default_rng(0)
    special = {0, 1, 2}
    clean = [list(np.random.default_rng(i).integers(3, 50, size=6)) + [2] for i in range(2000)]
    noisy = [corrupt_labels(c, 0.4, 50, special, rng) for c in clean]
    changed = [a != b for c, n in zip(clean, noisy) for a, b in zip(c[:-1], n[:-1])]
    assert abs(np.mean(changed) - 0.4) < 0.02
    assert all(n[-1] == 2 for n in noisy)  # EOS never corrupted
    assert all(t not in special for n in noisy for t in n[:-1])
    assert corrupt_labels(clean[0], 0.0, 50, special, rng) == clean[0]


def test_datamodule_noise_is_seeded_and_train_only(tmp_path: Path) -> None:
    f = write_squad_file(tmp_path / "s.json", articles=8)
    kw = dict(files=[str(f)], cache_dir=str(tmp_path), tokenizer_vocab_size=300,
              val_groups=2, test_groups=2)  # fmt: skip
    a = QADataModule(noise_rate=0.5, seed=1, **kw)
    b = QADataModule(noise_rate=0.5, seed=1, **kw)
    c = QADataModule(noise_rate=0.5, seed=2, **kw)
    for dm in (a, b, c):
        dm.setup("fit")
    la = [e.labels for e in a.encoded["train"]]
    assert la == [e.labels for e in b.encoded["train"]]
    assert la != [e.labels for e in c.encoded["train"]]
    assert any(e.labels != e.answer for e in a.encoded["train"])
    assert all(e.labels == e.answer for e in a.encoded["val"] + a.encoded["test"])


# ------------------------------------------------------------ distractors
def test_distractors_other_articles_random_positions(tmp_path: Path) -> None:
    f = write_squad_file(tmp_path / "s.json", articles=8)
    dm = QADataModule(files=[str(f)], cache_dir=str(tmp_path), tokenizer_vocab_size=300,
                      val_groups=2, test_groups=2, num_distractors=2)  # fmt: skip
    dm.setup("fit")
    train = dm.encoded["train"]
    assert all(e.n_distractors == 2 and e.n_passages == 3 for e in train)
    assert Counter(e.gold_index[0] for e in train).keys() == {0, 1, 2}
    # distractors come from other articles of the same split
    split = dm.splits["train"]
    pool = passage_pool(split)
    ex = split[0]
    rng = np.random.default_rng(0)
    ps = arrange_passages(ex, 2, "other_articles", pool, rng)
    groups = {p.text: g for g, p in pool}
    assert [p.gold for p in ps].count(True) == 1
    assert all(groups[p.text] != ex.group for p in ps if not p.gold)
    same = arrange_passages(ex, 2, "same_article", pool, rng)
    assert all(groups[p.text] == ex.group for p in same if not p.gold)
    test_texts = {p.text for e in dm.splits["test"] for p in e.gold}
    assert not any(p.text in test_texts for _, p in pool)


def test_dataset_distractors_hotpotqa(data_root: Path) -> None:
    ex = read_dataset(files(data_root, "hotpotqa"))[0]
    rng = np.random.default_rng(0)
    ps = arrange_passages(ex, 3, "auto", [], rng)
    assert len(ps) == 5 and sum(p.gold for p in ps) == 2
    own = {p.text for p in ex.distractors}
    assert all(p.text in own for p in ps if not p.gold)


def test_real_squad_datamodule(data_root: Path, tmp_path: Path) -> None:
    files(data_root, "squad")  # skips when absent
    dm = QADataModule(dataset="squad", cache_dir=str(tmp_path), max_length=256,
                      max_train_examples=300, max_eval_examples=100, tokenizer_vocab_size=512,
                      num_distractors=1, max_passage_tokens=100)  # fmt: skip
    dm.setup("fit")
    assert dm.vocab_size == 512
    assert (tmp_path / next(p.name for p in tmp_path.glob("tokenizer-*.json"))).is_file()
    tok = dm.load_tokenizer()
    for e in dm.encoded["train"] + dm.encoded["test"]:
        assert len(e.prompt) + len(e.answer) <= 256
    # the answer stays in the prompt for every example whose answer is in its passage
    hits = [any(a in tok.decode(e.prompt) for a in e.answers) for e in dm.encoded["train"]]
    assert np.mean(hits) > 0.99
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape


def test_cloze_questions_blank_a_span_of_their_passage() -> None:
    text = "The quick brown fox jumps over the lazy dog. It was seen by seven people that day."
    exs = cloze_examples([Passage(text)], 20, np.random.default_rng(0))
    assert len(exs) == 20
    for ex in exs:
        a = ex.answers[0]
        assert 1 <= len(a.split()) <= 4 and "_" in ex.question
        assert ex.answer_start is not None and text[ex.answer_start :].startswith(a)
        assert ex.question.replace("_", a) in text or a.rstrip(".") in text
