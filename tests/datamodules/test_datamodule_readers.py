"""Readers on small hand-written files: each format, sorting rules, k-core, sniffing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bft_lightning.datamodules.readers import (
    InteractionLog,
    kcore_filter,
    read_amazon,
    read_interactions,
    read_json,
    read_movielens,
    read_pairs,
    read_recbole,
    read_s3rec,
    sniff_format,
)


def test_s3rec(write):
    log = read_s3rec(write("a.txt", "1 5 3 5\n\n2 7 8\n"))
    assert log.users == [1, 2]
    assert log.sequences == [[5, 3, 5], [7, 8]]  # the repeat of 5 is kept
    assert log.timestamps is None
    assert (log.num_items, log.num_interactions) == (4, 5)


def test_pairs_append_in_file_order(write):
    log = read_pairs(write("p.txt", "2 9\n1 4\n2 3\n1 4\n"))
    assert log.users == [2, 1]
    assert log.sequences == [[9, 3], [4, 4]]


def test_json_zero_based(write):
    log = read_json(write("j.json", json.dumps({"0": [0, 1, 2], "1": [2, 0]})))
    assert log.users == [0, 1]
    assert log.sequences == [[0, 1, 2], [2, 0]]


def test_recbole_atomic_sorted_by_time_with_stable_ties(write):
    text = (
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
        "u1\ta\t5\t30\nu2\tx\t1\t5\nu1\tb\t4\t10\nu1\tc\t3\t30\nu1\td\t3\t20.7\n"
    )
    log = read_recbole(write("d.inter", text))
    assert log.users == ["u1", "u2"]
    assert log.sequences == [["b", "d", "a", "c"], ["x"]]  # a before c: tie in file order
    assert log.timestamps == [[10, 20, 30, 30], [5]]


def test_fractional_timestamps_order_by_their_exact_value(write):
    """100.9 and 100.1 both store 100, but b (100.1) came before a (100.9); whole and
    fractional times mix, also below zero; ties keep file order."""
    text = (
        "user_id:token\titem_id:token\ttimestamp:float\n"
        "u\ta\t100.9\nu\tb\t100.1\nu\tc\t101\nu\td\t100\nu\te\t100.1\n"
        "v\tp\t-0.5\nv\tq\t-1.5\nv\tr\t-1\n"
    )
    log = read_recbole(write("d.inter", text))
    assert log.sequences == [["d", "b", "e", "a", "c"], ["q", "r", "p"]]
    assert log.timestamps == [[100, 100, 100, 100, 101], [-1, -1, 0]]


def test_recbole_row_with_an_empty_last_field(write):
    """A tab-separated row whose last (unused) field is empty keeps its field count."""
    text = "user_id:token\titem_id:token\trating:float\n1\ta\t\n1\tb\t4\n"
    assert read_recbole(write("d.inter", text)).sequences == [["a", "b"]]


def test_recbole_atomic_without_time_keeps_file_order(write):
    log = read_recbole(write("d.inter", "item_id:token\tuser_id:token\nq\t1\np\t1\n"))
    assert log.sequences == [["q", "p"]] and log.timestamps is None


def _seq_split_files(write, seqs: dict[str, list[int]], window: int, descending: bool):
    """RecBole sequential train/valid/test files for ``seqs`` (like MQL4GRec's)."""
    header = "user_id:token\titem_id_list:token_seq\titem_id:token\n"
    out = {"train": [header], "valid": [header], "test": [header]}
    for user, s in seqs.items():
        rows = [
            f"{user}\t{' '.join(map(str, s[max(0, t - window) : t]))}\t{s[t]}\n"
            for t in range(1, len(s))
        ]
        train = rows[:-2][::-1] if descending else rows[:-2]
        out["train"] += train
        out["valid"].append(rows[-2])
        out["test"].append(rows[-1])
    for name, lines in out.items():
        write(f"X.{name}.inter", "".join(lines))


@pytest.mark.parametrize("descending", [True, False])
def test_recbole_sequential_rebuilds_truncated_histories(write, tmp_path, descending):
    seqs = {"0": [1, 2, 3, 4, 5, 6, 7, 8], "1": [9, 3, 9], "2": [4, 5, 6, 7]}
    _seq_split_files(write, seqs, window=3, descending=descending)
    log = read_recbole(tmp_path / "X.valid.inter")
    assert log.users == ["0", "1", "2"]
    assert log.sequences == [[str(i) for i in s] for s in seqs.values()]


def test_recbole_sequential_inconsistent_rows_fail(write, tmp_path):
    _seq_split_files(write, {"0": [1, 2, 3, 4, 5]}, window=50, descending=True)
    test_file = tmp_path / "X.test.inter"
    test_file.write_text(test_file.read_text().replace("1 2 3 4\t5", "1 2 9 4\t5"))
    with pytest.raises(ValueError, match="disagrees"):
        read_recbole(tmp_path / "X.train.inter")


@pytest.mark.parametrize(
    "name,text",
    [
        ("ratings.dat", "1::10::5::300\n1::11::3::100\n2::10::4::50\n1::12::4::100\n"),
        ("u.data", "1\t10\t5\t300\n1\t11\t3\t100\n2\t10\t4\t50\n1\t12\t4\t100\n"),
    ],
)
def test_movielens_both_formats(write, name, text):
    path = write(name, text)
    assert sniff_format(path) == "movielens"
    log = read_movielens(path)
    assert log.users == [1, 2]
    assert log.sequences == [[11, 12, 10], [10]]  # sorted by time, tie 11/12 in file order
    assert log.timestamps == [[100, 100, 300], [50]]


def _amazon_reviews(n_users: int = 3) -> list[tuple[str, str, int]]:
    """(user, item, time) rows: a 2-core block plus a chain that 2-core peels away."""
    rows = [(f"U{u}", f"I{i}", 100 * u + 10 * i) for u in range(n_users) for i in range(2)]
    rows += [("V", "I0", 1), ("V", "J", 2), ("W", "J", 3)]  # W has 1 -> J has 1 -> V has 1
    return rows


def test_amazon_json_lines_gz_with_kcore(write):
    rows = _amazon_reviews()
    text = "".join(
        json.dumps({"reviewerID": u, "asin": i, "unixReviewTime": t}) + "\n" for u, i, t in rows
    )
    path = write("reviews_X_5.json.gz", text, gz=True)
    assert sniff_format(path) == "amazon"
    full = read_amazon(path, kcore=0)
    assert full.num_users == 5 and full.sequences[3] == ["I0", "J"]
    core = read_amazon(path, kcore=2)
    assert core.users == ["U0", "U1", "U2"]
    assert core.sequences == [["I0", "I1"]] * 3
    assert core.timestamps == [[0, 10], [100, 110], [200, 210]]


@pytest.mark.parametrize(
    "header", ["", "item,user,rating,timestamp\n", "user_id,parent_asin,rating,timestamp\n"]
)
def test_amazon_csv(write, header):
    rows = _amazon_reviews()
    if header.startswith("user_id"):
        body = "".join(f"{u},{i},5.0,{t}\n" for u, i, t in rows)
    else:
        body = "".join(f"{i},{u},5.0,{t}\n" for u, i, t in rows)
    log = read_interactions(write("Cat.csv", header + body), kcore=2)  # sniffed: amazon
    assert log.users == ["U0", "U1", "U2"] and log.sequences == [["I0", "I1"]] * 3


@pytest.mark.parametrize("layout", ["2018", "2014", "2014-short-first-user", "bom-header", "bom"])
def test_amazon_csv_layouts_with_real_id_shapes(write, layout):
    """Headerless 2018 files put the ASIN first, 2014 files the reviewer; read the
    wrong way every user would become an item. A header after a BOM is a header."""
    users = ["A1XJ7Y9QW3ZPLM", "A2B8KDE01QXYTU", "AZC3RR0NOP6WQ"]
    if layout == "2014-short-first-user":  # an ASIN-shaped reviewer id first: rows vote
        users[0] = "A123456789"
    items = ["B00004TMFE", "0140449132", "123456789X"]
    rows = [(u, i, 10 * a + b) for a, u in enumerate(users) for b, i in enumerate(items)]
    if layout.startswith("2014"):
        text = "".join(f"{u},{i},5.0,{t}\n" for u, i, t in rows)
    else:
        text = "".join(f"{i},{u},5.0,{t}\n" for u, i, t in rows)
    if layout == "bom-header":
        text = "\ufeffitem,user,rating,timestamp\n" + text
    if layout == "bom":
        text = "\ufeff" + text
    log = read_interactions(write("Cat.csv", text), kcore=0)
    assert log.users == users
    assert log.sequences == [items] * 3


def _random_log(seed: int) -> InteractionLog:
    rng = np.random.default_rng(seed)
    seqs = [list(rng.zipf(1.6, size=rng.integers(1, 12)) % 40) for _ in range(60)]
    return InteractionLog(list(range(60)), seqs)


def _naive_kcore(seqs: list[list[int]], k: int) -> list[list[int]]:
    """Peel one offending user or item at a time until none is left (slow, obvious)."""
    seqs = [list(s) for s in seqs]
    while True:
        counts: dict[int, int] = {}
        for s in seqs:
            for i in s:
                counts[i] = counts.get(i, 0) + 1
        bad_item = next((i for i, c in counts.items() if c < k), None)
        if bad_item is not None:
            seqs = [[i for i in s if i != bad_item] for s in seqs]
        elif any(0 < len(s) < k for s in seqs):
            seqs = [s if len(s) >= k else [] for s in seqs]
        else:
            return [s for s in seqs if s]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kcore_is_the_unique_fixed_point(seed):
    log, k = _random_log(seed), 3
    core = kcore_filter(log, k)
    items = [i for s in core.sequences for i in s]
    assert core.num_users > 0
    assert min(len(s) for s in core.sequences) >= k
    assert min(items.count(i) for i in set(items)) >= k
    assert core.sequences == _naive_kcore(log.sequences, k)


def test_kcore_needs_several_rounds():
    # a chain: dropping W (1 item) drops J, which drops V below k
    log = InteractionLog(["a", "b", "V", "W"], [["x", "y"], ["x", "y"], ["x", "J"], ["J"]])
    assert kcore_filter(log, 2).users == ["a", "b"]
    assert kcore_filter(log, 1) is log


@pytest.mark.parametrize(
    "name,text,fmt",
    [
        ("s.txt", "1 2 3 4\n2 5\n", "s3rec"),
        ("p.txt", "1 2\n1 3\n", "pairs"),
        ("j.json", '{"0": [1, 2]}', "json"),
        ("r.dat", "1::2::3::4\n", "movielens"),
        ("x.inter", "user_id:token\titem_id:token\n1\t2\n", "recbole"),
        ("y.txt", "user_id:token\titem_id:token\n1\t2\n", "recbole"),
    ],
)
def test_sniff_format(write, name, text, fmt):
    assert sniff_format(write(name, text)) == fmt


def test_amazon_json_lines_after_a_bom(write):
    """A BOM before the first review is not part of it: the file is still read as JSON
    lines (it went to the CSV reader before)."""
    rows = [("U0", "I0", 0), ("U0", "I1", 10)]
    text = "".join(
        json.dumps({"reviewerID": u, "asin": i, "unixReviewTime": t}) + "\n" for u, i, t in rows
    )
    log = read_amazon(write("reviews.json", "\ufeff" + text), kcore=0)
    assert log.users == ["U0"] and log.sequences == [["I0", "I1"]]
