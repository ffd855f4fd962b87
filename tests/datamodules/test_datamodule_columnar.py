"""The columnar fast path gives exactly the line-exact readers' logs; Parquet; prefix rows."""

from __future__ import annotations

import gzip
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bft_lightning.datamodules import cache as cache_mod
from bft_lightning.datamodules.readers import (
    InteractionLog,
    columnar,
    kcore_filter,
    read_interactions,
)
from bft_lightning.datamodules.splits import encode, leave_one_out, train_arrays
from bft_lightning.datamodules.windows import PrefixRows


def _rows(seed: int, n: int = 400, fractional: bool = False):
    """Random (user, item, time) rows with repeats, ties and out-of-order times."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 30, n)
    items = rng.zipf(1.5, n) % 50
    times = rng.integers(0, 40, n).astype(float)  # many ties
    if fractional:
        times += rng.choice([0.0, 0.25, 0.5, 0.75], n)
    return users, items, times


def _fmt_time(t: float) -> str:
    return str(int(t)) if t == int(t) else repr(float(t))


def _text(fmt: str, rows) -> str:
    users, items, times = rows
    body = {
        "pairs": [f"{u} {i}" for u, i in zip(users, items)],
        "movielens": [f"{u}::{i}::5::{_fmt_time(t)}" for u, i, t in zip(users, items, times)],
        "udata": [f"{u}\t{i}\t3\t{_fmt_time(t)}" for u, i, t in zip(users, items, times)],
        "recbole": ["user_id:token\titem_id:token\ttimestamp:float"]
        + [f"u{u}\ti{i}\t{_fmt_time(t)}" for u, i, t in zip(users, items, times)],
        "amazon": ["item,user,rating,timestamp"]
        + [f"B{i:09d},A{u}X,5.0,{_fmt_time(t)}" for u, i, t in zip(users, items, times)],
        "amazon_headerless": [
            f"B{i:09d},A{u}XYZW1234,4,{_fmt_time(t)}" for u, i, t in zip(users, items, times)
        ],
    }[fmt]
    return "\n".join(body) + "\n"


CASES = {
    "pairs": ("p.txt", "pairs"),
    "movielens": ("ratings.dat", "movielens"),
    "udata": ("u.data", "movielens"),
    "recbole": ("x.inter", "recbole"),
    "amazon": ("a.csv", "amazon"),
    "amazon_headerless": ("b.csv", "amazon"),
}


def _exact(monkeypatch, path, fmt):
    """The same file read line by line (the fast path switched off)."""
    with monkeypatch.context() as m:
        m.setattr(columnar, "read_delimited", lambda *a, **k: None)
        return read_interactions(path, fmt, kcore=0)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fractional", [False, True])
@pytest.mark.parametrize("gz", [False, True])
def test_fast_path_equals_the_exact_reader(write, monkeypatch, case, fractional, gz):
    if case == "pairs" and fractional:
        pytest.skip("pairs have no timestamps")
    name, fmt = CASES[case]
    path = write(name + (".gz" if gz else ""), _text(case, _rows(7, fractional=fractional)), gz)
    used = []
    real = columnar.build
    monkeypatch.setattr(columnar, "build", lambda *a, **k: used.append(1) or real(*a, **k))
    fast = read_interactions(path, fmt, kcore=0)
    assert used, "the fast path was not taken on a well-formed file"
    exact = _exact(monkeypatch, path, fmt)
    assert fast.users == exact.users
    assert fast.sequences == exact.sequences
    assert fast.timestamps == exact.timestamps
    assert fast.num_interactions == 400  # nothing dropped, duplicates kept


def test_fractional_times_order_exactly_and_store_whole_seconds(write):
    text = "1::10::5::100.75\n1::11::5::100.25\n1::12::5::100\n1::13::5::99.5\n"
    log = read_interactions(write("ratings.dat", text), "movielens")
    assert log.sequences == [[13, 12, 11, 10]] and log.timestamps == [[99, 100, 100, 100]]


def test_ids_beyond_int64_are_kept_exact(write):
    big = 10**25
    log = read_interactions(write("p.txt", f"{big} 7\n{big} {big + 1}\n3 7\n"), "pairs")
    assert log.users == [big, 3] and log.sequences == [[7, big + 1], [7]]


def test_json_may_be_gzipped(write):
    plain = read_interactions(write("j.json", '{"0": [1, 2], "1": [2]}'), "json")
    packed = read_interactions(write("k.json.gz", '{"0": [1, 2], "1": [2]}', gz=True), "json")
    assert plain == packed and plain.sequences == [[1, 2], [2]]


def _parquet(tmp_path, table: dict, name="log.parquet"):
    path = tmp_path / name
    pq.write_table(pa.table(table), path)
    return path


def test_parquet_matches_the_csv(write, tmp_path):
    users, items, times = _rows(3, fractional=True)
    csv_log = read_interactions(write("a.csv", _text("amazon", (users, items, times))), kcore=0)
    path = _parquet(
        tmp_path,
        {
            "item": [f"B{i:09d}" for i in items],
            "user": [f"A{u}X" for u in users],
            "timestamp": times,
        },
    )
    log = read_interactions(path)  # sniffed by name
    assert (log.users, log.sequences, log.timestamps) == (
        csv_log.users,
        csv_log.sequences,
        csv_log.timestamps,
    )


def test_parquet_integer_ids_and_timestamp_type(tmp_path):
    stamps = pa.array([3_000, 1_500, 1_000, 2_000], pa.timestamp("ms"))
    path = _parquet(
        tmp_path,
        {"user_id": [5, 5, 6, 5], "item_id": [1, 2, 3, 4], "time": stamps},
        name="log.pq",
    )
    log = read_interactions(path, "parquet")
    assert log.users == [5, 6] and log.sequences == [[2, 4, 1], [3]]
    assert log.timestamps == [[1, 2, 3], [1]]  # whole seconds; 1.5 s sorts before 2 s


def test_parquet_without_time_keeps_row_order(tmp_path):
    path = _parquet(tmp_path, {"user": ["b", "a", "b"], "item": ["x", "y", "z"]})
    log = read_interactions(path)
    assert log.users == ["b", "a"] and log.sequences == [["x", "z"], ["y"]]
    assert log.timestamps is None


def test_log_from_lists_round_trips_and_kcore_matches():
    seqs = [["a", "b", "a"], ["d", "c"], ["a", "b", "c", "c"], ["b", "e"]]
    times = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [1, 2]]
    log = InteractionLog(["u", "v", "w", "x"], seqs, times)
    assert log.sequences == seqs and log.num_items == 5 and log.num_interactions == 11
    core = kcore_filter(log, 2)  # d and e once: v and x fall to one item, then go
    assert core.users == ["u", "w"] and core.sequences == [seqs[0], seqs[2]]
    assert core.timestamps == [times[0], times[2]] and core.num_items == 3


def test_encode_numbers_items_by_first_appearance():
    log = InteractionLog([9, 8], [[30, 10, 30], [20, 10]])
    data = encode(log)
    assert data.items.tolist() == [1, 2, 1, 3, 2]
    assert data.item_ids.tolist() == ["", "30", "10", "20"] and data.user_ids.tolist() == ["9", "8"]


@pytest.mark.parametrize("max_len", [1, 3, 50])
def test_prefix_rows_equal_the_materialised_arrays(max_len):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 20, n).tolist() for n in rng.integers(1, 12, 40)]
    times = [sorted(rng.integers(0, 1000, len(s)).tolist()) for s in seqs]
    data = encode(InteractionLog(list(range(40)), seqs, times))
    split = leave_one_out(data)
    full = train_arrays(data, split, max_len, rows="prefix")
    rows = PrefixRows(data, split, max_len)
    assert len(rows) == len(full["seq"])
    order = rng.permutation(len(rows)).tolist()
    lazy = rows.__getitems__(order)
    for key, value in full.items():
        assert np.array_equal(lazy[key], value[order]), key
    assert np.array_equal(rows.row_lengths(), (full["seq"] != 0).sum(axis=1))
    one = rows[5]
    assert np.array_equal(one["seq"], full["seq"][5]) and one["user"] == full["user"][5]
    with pytest.raises(IndexError):
        rows.__getitems__([len(rows)])


def test_prefix_rows_state_is_per_user():
    seqs = [list(range(1, 200))] * 30
    data = encode(InteractionLog(list(range(30)), seqs))
    rows = PrefixRows(data, leave_one_out(data), max_len=50)
    state = rows.users.nbytes + rows.start.nbytes + rows.first.nbytes
    assert len(rows) == 30 * 196 and state < 30 * 3 * 8 + 16  # O(users), not O(rows * max_len)


def test_cache_is_not_parsed_again(write, tmp_path, monkeypatch):
    src = write("ratings.dat", _text("movielens", _rows(1)))
    first = cache_mod.load_sequences(src, None, 0, tmp_path / "c")
    monkeypatch.setattr(cache_mod, "read_interactions", lambda *a, **k: 1 / 0)
    again = cache_mod.load_sequences(src, None, 0, tmp_path / "c")
    assert again.items.tolist() == first.items.tolist() and isinstance(again.items, np.memmap)


def test_gzip_round_trip_of_helper(tmp_path):
    path = tmp_path / "x.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("1 2\n")
    assert read_interactions(path, "pairs").sequences == [[2]]


ODD_BUT_VALID = [
    (
        "x.inter",
        "recbole",
        "user_id:token\titem_id:token\ttimestamp:float\n u1 \t i2\t5\nu1\ti3\t4\n",
    ),
    (
        "a.csv",
        "amazon",
        'item,user,rating,timestamp\n"B1,x",A1,5,7\r\nB2,A1,5,3\r\n\r\nB1,A2,5,1\n',
    ),
    ("p.txt", "pairs", "007 1\n7 2\n\n  \n7 3\n"),
    ("ratings.dat", "movielens", "1::5::x::10\n1::6::y::-3.5\n2::5::z::1e3\n"),
    ("u.data", "movielens", "1\t5\t3\t+10\n1\t6\t3\t 9\n"),
    ("x.inter", "recbole", "user_id:token\titem_id:token\tuser_id:token\nu1\ti1\tu2\n"),
    ("b.csv", "amazon", "B000000001,A1,5,1\nB000000002,A1,5,2\n\n"),
]


@pytest.mark.parametrize("name,fmt,text", ODD_BUT_VALID)
def test_odd_but_valid_files_read_as_the_exact_reader_reads_them(
    write, monkeypatch, name, fmt, text
):
    path = write(name, text)
    try:
        exact = _exact(monkeypatch, path, fmt)
    except ValueError as err:  # the exact reader refuses it: so must the default path
        with pytest.raises(ValueError, match=re.escape(str(err))):
            read_interactions(path, fmt, kcore=0)
        return
    fast = read_interactions(path, fmt, kcore=0)
    assert (fast.users, fast.sequences, fast.timestamps) == (
        exact.users,
        exact.sequences,
        exact.timestamps,
    )


@pytest.mark.parametrize("layout", ["grouped_sorted", "grouped_unsorted", "time_ordered", "mixed"])
def test_row_order_shortcuts_equal_the_full_sort(layout):
    from bft_lightning.datamodules.readers.log import _order

    rng = np.random.default_rng(1)
    user = rng.integers(0, 50, 3000)
    key = rng.integers(0, 100, 3000).astype(float)
    if layout.startswith("grouped"):
        user = np.sort(user)
    if layout in ("grouped_sorted", "time_ordered"):
        key = np.sort(key) if layout == "time_ordered" else key[np.lexsort((key, user))]
    order = _order(user, key)
    expect = np.lexsort((key, user))
    got = np.arange(len(user)) if order is None else order
    assert np.array_equal(got, expect)
    assert (order is None) == (layout == "grouped_sorted")


@pytest.mark.parametrize(
    "tokens",
    [
        ["7", "07", "7"],  # a leading zero: another string id
        ["00", "0", "0"],
        ["0", "10", "100", "99", "999999999999999999", "1000000000000000000"],
        ["9223372036854775807", "1"],  # int64's largest
        ["12345678901234567890", "1"],  # beyond int64
        ["a1", "B2", "a1"],
        [" u ", "u", "v\t"],  # stripped
    ],
)
def test_token_codes_keep_string_identity(tokens):
    col = pa.chunked_array(
        [pa.array(["x", *tokens[:2]]).slice(1), pa.array(tokens[2:], pa.string())]
    )
    codes, vocab = columnar.token_codes(col)
    stripped = [t.strip() for t in tokens]
    assert [str(vocab[c]) for c in codes] == stripped
    assert len(vocab) == len(set(stripped)) and all(isinstance(v, str) for v in vocab.tolist())


@pytest.fixture()
def small_blocks(monkeypatch):
    """Parse in blocks of a few lines and merge vocabularies often (the 20M-row path)."""
    from bft_lightning.datamodules.readers import coding, parquet

    monkeypatch.setattr(columnar, "BLOCK_BYTES", 97)
    monkeypatch.setattr(coding, "MERGE_MIN", 5)
    monkeypatch.setattr(parquet, "_BATCH_ROWS", 7)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("gz", [False, True])
def test_block_by_block_equals_the_exact_reader(write, monkeypatch, small_blocks, case, gz):
    name, fmt = CASES[case]
    path = write(name + (".gz" if gz else ""), _text(case, _rows(11, fractional=True)), gz)
    used = []
    real = columnar.build
    monkeypatch.setattr(columnar, "build", lambda *a, **k: used.append(1) or real(*a, **k))
    fast = read_interactions(path, fmt, kcore=0)
    assert used, "the fast path was not taken on a well-formed file"
    exact = _exact(monkeypatch, path, fmt)
    assert (fast.users, fast.sequences, fast.timestamps) == (
        exact.users,
        exact.sequences,
        exact.timestamps,
    )
    assert fast.num_interactions == 400


@pytest.mark.parametrize(
    "later",
    ["u07", "u 7", "ux", "u-3"],  # a later block with a leading zero, a space, letters, a sign
)
def test_token_vocabulary_turns_to_strings_in_a_later_block(
    write, monkeypatch, small_blocks, later
):
    head = "user_id:token\titem_id:token\ttimestamp:float\n"
    early = "".join(f"{u}\t{i}\t{t}\n" for t, (u, i) in enumerate([(7, 10), (8, 70)] * 20))
    tail = "".join(f"{u}\t{i}\t{t}\n" for t, (u, i) in enumerate([(later[1:], "010"), (7, 10)]))
    path = write("x.inter", head + early + tail)
    fast = read_interactions(path, "recbole", kcore=0)
    exact = _exact(monkeypatch, path, "recbole")
    assert (fast.users, fast.sequences) == (exact.users, exact.sequences)
    assert all(isinstance(u, str) for u in fast.users)


def test_bad_line_in_a_later_block_is_named(write, small_blocks):
    rows = [f"B{i:09d},A{i % 7}X,5.0,{i}" for i in range(200)]
    rows[150] = "B000000001,A1X,5.0,notatime"
    path = write("a.csv", "item,user,rating,timestamp\n" + "\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"a\.csv:152: non-numeric timestamp"):
        read_interactions(path, "amazon", kcore=0)


def test_parquet_in_batches_equals_one_batch_and_names_later_rows(write, tmp_path, monkeypatch):
    from bft_lightning.datamodules.readers import parquet

    users, items, times = _rows(5, fractional=True)
    table = {"item": [f"B{i:09d}" for i in items], "user": [f"A{u}X" for u in users],
             "timestamp": times}  # fmt: skip
    path = _parquet(tmp_path, table)
    whole = read_interactions(path)
    monkeypatch.setattr(parquet, "_BATCH_ROWS", 7)
    batched = read_interactions(path)
    assert (batched.users, batched.sequences, batched.timestamps) == (
        whole.users,
        whole.sequences,
        whole.timestamps,
    )
    table["user"][300] = "  "
    with pytest.raises(ValueError, match=r"row 301 \(column 'user'\): empty id"):
        read_interactions(_parquet(tmp_path, table, "bad.parquet"))
