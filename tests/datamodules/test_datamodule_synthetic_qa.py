"""Generated extractive QA: seeded, answers copied from their passage, exact label noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bft_lightning.lm.data.synthetic_qa import (
    RELATIONS,
    SPECIALS,
    SyntheticQADataModule,
    SyntheticQAPretrainDataModule,
    collate_synthetic,
)
from bft_lightning.lm.task import token_loss

SMALL = dict(num_train=300, num_val=20, num_test=50)


def make(**kw):
    dm = SyntheticQADataModule(**(SMALL | kw))
    dm.setup()
    return dm


def words(dm, ids):
    return [dm.words[i] for i in ids]


def passages_of(dm, ex):
    """The prompt's passages as word lists (BOS dropped, cut at '|', question removed)."""
    w = words(dm, ex.prompt[1:])
    body = w[: w.index("Question")]
    out, cur = [], []
    for x in body:
        if x == "|":
            out.append(cur)
            cur = []
        else:
            cur.append(x)
    return out + [cur]


def test_deterministic_and_seeded():
    a, b = make(num_distractors=2, noise_rate=0.2), make(num_distractors=2, noise_rate=0.2)
    for split in ("train", "val", "test"):
        assert [(e.prompt, e.answer, e.labels) for e in a.encoded[split]] == [
            (e.prompt, e.answer, e.labels) for e in b.encoded[split]
        ]
    other = make(num_distractors=2, noise_rate=0.2, data_seed=1)
    assert [e.prompt for e in other.encoded["test"]] != [e.prompt for e in a.encoded["test"]]
    # the noise seed moves the corrupted labels, never the questions
    noisy = make(num_distractors=2, noise_rate=0.2, seed=1)
    assert [e.prompt for e in noisy.encoded["train"]] == [e.prompt for e in a.encoded["train"]]
    assert [e.labels for e in noisy.encoded["train"]] != [e.labels for e in a.encoded["train"]]


def test_counts_and_distractors_per_question():
    for k in (0, 2, 4):
        dm = make(num_distractors=k)
        assert {s: len(e) for s, e in dm.encoded.items()} == {"train": 300, "val": 20, "test": 50}
        for ex in dm.encoded["train"][:50]:
            assert ex.n_distractors == k and ex.n_passages == k + 1
            assert len(passages_of(dm, ex)) == k + 1
            assert [i for i, p in enumerate(passages_of(dm, ex))] and ex.gold_index[0] <= k
    with pytest.raises(ValueError, match="num_distractors=5 exceeds max_distractors=4"):
        SyntheticQADataModule(num_distractors=5)


def test_answer_is_a_span_of_its_gold_passage():
    dm = make(num_distractors=4)
    for ex in dm.encoded["train"] + dm.encoded["test"]:
        a0, a1 = ex.answer_span
        g0, g1 = ex.gold_span
        assert g0 <= a0 < a1 <= g1
        assert ex.prompt[a0:a1] == ex.answer[:-1]  # copied from the passage, EOS after
        assert ex.answer[-1] == dm.tokenizer.eos_id
        q = words(dm, ex.prompt)
        rel, ent = q[-6], q[-4]  # "... the <rel> of <ent> ? Answer :"
        assert q[a0 - 2 : a0] == [ent, rel] and q[a1] == "."
        assert " ".join(words(dm, ex.answer[:-1])) == ex.answers[0]
        assert set(words(dm, ex.answer[:-1])) <= set(RELATIONS[rel])


def test_relation_first_order_moves_only_the_word_order():
    a = make(num_distractors=4)
    b = make(num_distractors=4, fact_order="relation_first")
    for x, y in zip(a.encoded["train"], b.encoded["train"]):
        assert x.answer == y.answer and len(x.prompt) == len(y.prompt)
        qx, qy = words(a, x.prompt), words(b, y.prompt)
        assert qx[-10:] == qy[-10:]  # the question is the same
        rel, ent = qy[-6], qy[-4]
        a0, a1 = y.answer_span
        assert y.prompt[a0:a1] == y.answer[:-1]
        assert qy[a0 - 2 : a0] == [rel, ent]  # "<rel> <ent> <value> ."
        assert sorted(qx) == sorted(qy)
    pre = SyntheticQAPretrainDataModule(
        num_documents=50, seq_len=64, fact_order="relation_first", **SMALL
    )
    pre.setup()
    w = [pre.words[i] for i in pre.chunks["train"][0]]
    j = w.index("recall")
    assert w[j + 1] in RELATIONS and w[j + 2] in pre.entities
    with pytest.raises(ValueError, match="fact_order must be one of"):
        SyntheticQADataModule(fact_order="value_first")


def test_distractors_never_hold_the_answer_entitys_fact():
    dm = make(num_distractors=4)
    for ex in dm.encoded["train"]:
        q = words(dm, ex.prompt)
        rel, ent = q[-6], q[-4]
        ps = passages_of(dm, ex)
        for i, p in enumerate(ps):
            if i == ex.gold_index[0]:
                assert ent in p
                continue
            assert ent not in p  # about another entity
            assert rel in p  # a hard distractor: the asked relation, another value
            j = p.index(rel)
            value = p[j + 1 : p.index(".", j)]
            assert value != words(dm, ex.answer[:-1])


def test_questions_identical_across_distractor_counts():
    a, b = make(num_distractors=0), make(num_distractors=4)
    for x, y in zip(a.encoded["test"], b.encoded["test"]):
        assert x.answer == y.answer and x.prompt[-11:] == y.prompt[-11:]
        assert (
            x.prompt[x.gold_span[0] : x.gold_span[1]] == y.prompt[y.gold_span[0] : y.gold_span[1]]
        )


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.3, 1.0])
def test_noise_rate_exact_and_recorded(rate):
    dm = make(noise_rate=rate)
    train = dm.encoded["train"]
    total = sum(len(e.answer) - 1 for e in train)
    n_bad = sum(len(e.corrupted) for e in train)
    assert n_bad == round(rate * total)
    assert dm.corrupted_fraction == pytest.approx(round(rate * total) / total)
    special = {dm.words.index(w) for w in SPECIALS}
    for e in train:
        diff = [j for j, (x, y) in enumerate(zip(e.answer, e.labels)) if x != y]
        assert diff == sorted(e.corrupted)  # every corruption recorded, and only those
        assert e.labels[-1] == dm.tokenizer.eos_id  # EOS never corrupted
        assert all(e.labels[j] not in special for j in e.corrupted)
        assert e.prompt[e.answer_span[0] : e.answer_span[1]] == e.answer[:-1]  # inputs clean
    for split in ("val", "test"):  # evaluation labels are never corrupted
        assert all(not e.corrupted and e.labels == e.answer for e in dm.encoded[split])


def test_noise_in_inputs_corrupts_the_read_answer():
    dm = make(noise_rate=0.3, noise_in_inputs=True)
    e = next(e for e in dm.encoded["train"] if e.corrupted)
    assert e.answer == e.labels  # teacher forcing reads the noisy answer
    assert e.prompt[e.answer_span[0] : e.answer_span[1]] != e.answer[:-1]


def test_batch_mask_marks_the_corrupted_targets():
    dm = make(noise_rate=0.3, num_distractors=2)
    items = dm.encoded["train"][:16]
    b = collate_synthetic(items)
    assert int(b["label_corrupted"].sum()) == sum(len(e.corrupted) for e in items)
    for i, e in enumerate(items):
        m = len(e.prompt)
        for j in range(len(e.answer)):
            assert int(b["labels"][i, m - 1 + j]) == e.labels[j]
            assert bool(b["label_corrupted"][i, m - 1 + j]) == (j in e.corrupted)
            assert int(b["input_ids"][i, m + j - 1]) == (e.prompt + e.answer)[m + j - 1]
    # left-padded prompts end where the answer starts
    assert (
        b["prompt_ids"][:, -2:] == torch.tensor([dm.words.index("Answer"), dm.words.index(":")])
    ).all()


def test_tokenizer_roundtrip_and_generation_speed():
    import time

    t = time.time()
    dm = SyntheticQADataModule(num_train=2000, num_val=100, num_test=500, num_distractors=4)
    dm.setup()
    assert time.time() - t < 60  # generated in seconds (generous on a loaded host)
    tok = dm.load_tokenizer()
    ex = dm.encoded["test"][0]
    text = tok.decode(ex.prompt)
    assert tok.encode(text) == ex.prompt[1:]  # BOS is special, dropped by decode
    assert tok.decode(ex.answer) == ex.answers[0]
    assert tok.vocab_size == dm.vocab_size == len(dm.words)


def test_pretraining_text_has_no_question_template():
    dm = SyntheticQAPretrainDataModule(num_documents=200, seq_len=64, packing="stream", **SMALL)
    dm.setup()
    ids = [i for c in dm.chunks["train"] for i in c]
    assert all(len(c) == 65 for c in dm.chunks["train"])
    used = {dm.words[i] for i in ids}
    assert "Question" not in used and "Answer" not in used and "recall" in used
    # the recall line restates a fact of its document: "recall e r value ."
    w = [dm.words[i] for i in ids]
    j = w.index("recall")
    doc = w[max(0, j - 300) : j]
    fact = w[j + 1 : w.index(".", j) + 1]
    assert " ".join(fact) in " ".join(doc) or len(doc) < 300


def _documents(dm: SyntheticQAPretrainDataModule, n: int) -> list[list[int]]:
    from bft_lightning.lm.data.synthetic_qa import _rng

    return [dm.document(_rng(dm.data_seed, 3, i), f"doc-{i}") for i in range(n)]


def test_document_packing_keeps_every_recall_line_with_its_passages():
    dm = SyntheticQAPretrainDataModule(
        num_documents=300, seq_len=64, facts_per_passage=2, max_value_words=1, **SMALL
    )
    dm.setup()
    rows = dm.chunks["train"]
    eos = dm.tokenizer.eos_id
    # nothing lost or reordered: the rows are the documents, concatenated
    docs = _documents(dm, 300)
    assert max(len(d) for d in docs) <= 65  # each fits a row, so none is cut
    assert [t for r in rows for t in r] == [t for d in docs for t in d]
    assert all(2 <= len(r) <= 65 for r in rows)
    for r in rows:  # every row starts a document, and every recall fact is in its row
        assert r[0] == eos
        w = [dm.words[i] for i in r]
        for j, x in enumerate(w):
            if x == "recall":
                fact = " ".join(w[j + 1 : w.index(".", j) + 1])
                start = max(k for k in range(j + 1) if r[k] == eos)
                passages = " ".join(w[start:j]).split(" recall ")[0]
                assert fact in passages
    batch = next(iter(dm.train_dataloader()))
    pad = batch["attention_mask"] == 0
    assert pad.any()  # ragged rows are padded ...
    assert (batch["labels"][pad] == -100).all()  # ... and the padding is out of the loss
    real = ~pad
    assert (batch["labels"][real] != -100).all()


def test_document_rows_packs_whole_documents_and_cuts_only_long_ones():
    from bft_lightning.lm.data.qa import collate_rows, document_rows

    docs = [[9, 1, 2], [9, 3], [9, 4, 5, 6], [9] + list(range(10, 22)), [9, 7]]
    rows = document_rows(docs, 4)  # rows of at most 5 tokens
    assert rows[0] == [9, 1, 2, 9, 3] and rows[1] == [9, 4, 5, 6]
    # the 13-token document takes rows of its own, overlapping by one token (inputs + targets)
    long_rows = rows[2:-1]
    assert all(len(r) <= 5 for r in long_rows)
    assert [t for r in long_rows for t in r[1:]] == docs[3][1:]
    assert rows[-1] == [9, 7]
    b = collate_rows(rows, pad_id=0)
    assert b["input_ids"].shape == (len(rows), 4)
    assert b["labels"][1].tolist() == [4, 5, 6, -100]
    assert b["attention_mask"][1].tolist() == [1, 1, 1, 0]
    assert b["labels"][0].tolist() == [1, 2, 9, 3]


def test_label_smoothing_matches_torch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, :2] = -100
    ref = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), label_smoothing=0.1)
    assert torch.allclose(token_loss(logits, labels, "ce", smoothing=0.1), ref, atol=1e-6)
    assert torch.allclose(
        token_loss(logits, labels, "ce"),
        F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1)),
    )


def test_corruption_draw_is_uniform_over_non_special_ids():
    dm = make(num_train=2000, noise_rate=1.0)
    new = np.array([e.labels[j] for e in dm.encoded["train"] for j in e.corrupted])
    counts = np.bincount(new, minlength=dm.vocab_size)
    assert counts[:3].sum() == 0
    # roughly uniform: no id takes more than 4x its share
    assert counts[3:].max() < 4 * len(new) / (dm.vocab_size - 3)
