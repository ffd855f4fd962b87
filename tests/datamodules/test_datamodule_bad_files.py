"""Bad data files across formats: one clear message naming the file and the line
(or row and column), no cache entry written, the input unchanged.

Each case goes through ``load_sequences`` with a cache folder, as the DataModule
reads: the fast columnar path must hand every one of these to the line-exact
reader (or refuse it itself) rather than read it wrongly.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bft_lightning.datamodules.cache import load_sequences

ML = "1::10::5::100\n1::11::5::200\n2::10::5::300\n"
CSV = "item,user,rating,timestamp\nB1,A1,5,100\nB2,A1,5,200\n"
INTER = "user_id:token\titem_id:token\ttimestamp:float\nu1\ti1\t10\nu1\ti2\t20\n"

TEXT_CASES = [
    # name, file, content (str or bytes), format, message (regex after the file name)
    ("ml_truncated_last_number", "ratings.dat", ML + "2::11::5::97", "movielens",
     r":4: the last line has no line end: the file looks truncated"),
    ("pairs_truncated", "p.txt", "1 2\n1 3\n2 4", "pairs", r":3: the last line has no line end"),
    ("csv_truncated", "a.csv", CSV + "B3,A2,5,30", "amazon", r":4: the last line has no line"),
    ("inter_truncated", "x.inter", INTER + "u2\ti1\t3", "recbole", r":4: the last line has no"),
    ("s3rec_truncated", "s.txt", "1 2 3\n2 4 5", "s3rec", r":2: the last line has no line end"),
    ("pairs_hex_id", "p.txt", "1 2\n1 0x10\n", "pairs", r":2: non-integer item id '0x10'"),
    ("ml_plus_sign_user", "ratings.dat", ML + "+5::10::5::1\n", "movielens",
     r":4: non-integer user id '\+5'"),
    ("ml_negative_item", "ratings.dat", ML + "3::-10::5::1\n", "movielens",
     r":4: negative item id -10"),
    ("ml_huge_timestamp", "ratings.dat", ML + "3::10::5::1e300\n", "movielens",
     r":4: timestamp '1e300' out of range"),
    ("udata_nan_timestamp", "u.data", "1\t2\t5\t7\n1\t3\t5\tnan\n", "movielens",
     r":2: non-finite timestamp 'nan'"),
    ("csv_hex_timestamp", "a.csv", CSV + "B3,A2,5,0x10\n", "amazon",
     r":4: non-numeric timestamp '0x10'"),
    ("csv_empty_user", "a.csv", CSV + "B3, ,5,10\n", "amazon", r":4: user: empty id"),
    ("inter_empty_timestamp", "x.inter", INTER + "u2\ti1\t\n", "recbole",
     r":4: non-numeric timestamp ''"),
    ("s3rec_id_of_5000_digits", "s.txt", "1 2 3\n2 " + "9" * 5000 + "\n", "s3rec",
     r":2: item id: id of 5000 characters \(at most 256\)"),
    ("csv_id_of_1000_chars", "a.csv", CSV + "B3," + "A" * 1000 + ",5,10\n", "amazon",
     r":4: user: id of 1000 characters"),
    ("json_number_of_5000_digits", "j.json", '{"0": [1,\n 2, ' + "7" * 5000 + "]}", "json",
     r":2: a number of 5000 digits \(ids have at most 256\)"),
    ("json_utf16", "j.json", codecs.BOM_UTF16_LE + '{"0": [1]}'.encode("utf-16-le"), "json",
     r": cannot read file \(it starts with a UTF-16 byte-order mark; save it as UTF-8\)"),
    ("csv_utf16", "a.csv", codecs.BOM_UTF16_BE + CSV.encode("utf-16-be"), "amazon",
     r": cannot read file \(it starts with a UTF-16 byte-order mark"),
    ("json_gzip_cut", "j.json.gz", gzip.compress(b'{"0": [1, 2, 3]}')[:-9], "json",
     r": cannot read file"),
    ("json_gzip_broken_inside", "j.json.gz", gzip.compress(b'{"0": [1,\n 2,, 3]}'), "json",
     r":2: broken JSON"),
    ("ml_latin1_byte", "ratings.dat", ML.encode() + b"3::1\xe9::5::1\n", "movielens",
     r":4: cannot read file: not UTF-8 text \(byte 0xe9\)"),
    ("json_latin1_byte", "j.json", b'{"0": [1],\n "1": "\xe9"}', "json",
     r":2: not UTF-8 text \(byte 0xe9\)"),
    ("inter_wrong_width", "x.inter", INTER + "u2\ti1\t3\textra\n", "recbole",
     r":4: expected 3 tab-separated fields, got 4"),
]  # fmt: skip


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _refused(tmp_path: Path, path: Path, fmt: str | None, message: str) -> None:
    cache = tmp_path / "cache"
    before = _digest(path.parent)
    with pytest.raises(ValueError, match=re.escape(str(path)) + message) as info:
        load_sequences(path, fmt, 0, cache)
    assert "\n" not in str(info.value)  # one message
    assert not cache.exists() or list(cache.iterdir()) == []  # no cache entry, no temp folder
    assert _digest(path.parent) == before  # nothing changed or lost


def test_enough_cases():
    assert len(TEXT_CASES) + len(PARQUET_CASES) >= 15


@pytest.mark.parametrize(
    "name,file,content,fmt,message", TEXT_CASES, ids=[c[0] for c in TEXT_CASES]
)
def test_bad_text_file(tmp_path, name, file, content, fmt, message):
    folder = tmp_path / "in"
    folder.mkdir()
    path = folder / file
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    _refused(tmp_path, path, fmt, message)


PARQUET_CASES = [
    ("null_user", {"user": pa.array(["a", None, "b"]), "item": ["x", "y", "z"]},
     r": row 2 \(column 'user'\): null id"),
    ("negative_item", {"user": [1, 1, 2], "item": [3, -4, 5]},
     r": row 2 \(column 'item'\): negative id -4"),
    ("blank_item", {"user": ["a", "b"], "item": ["x", "  "]},
     r": row 2 \(column 'item'\): empty id"),
    ("float_ids", {"user": [1.0, 2.0], "item": [1, 2]},
     r": column 'user' has type double; ids are integers or strings"),
    ("no_item_column", {"user": [1, 2], "thing": [1, 2]}, r": no item column"),
    ("null_time", {"user": [1, 2], "item": [1, 2], "timestamp": pa.array([5, None])},
     r": row 2 \(column 'timestamp'\): null timestamp"),
    ("nan_time", {"user": [1, 2], "item": [1, 2], "timestamp": [5.0, float("nan")]},
     r": row 2 \(column 'timestamp'\): non-finite or out-of-range timestamp"),
    ("long_id", {"user": ["a", "u" * 300], "item": ["x", "y"]},
     r": row 2 \(column 'user'\): id longer than 256 characters"),
]  # fmt: skip


@pytest.mark.parametrize("name,columns,message", PARQUET_CASES, ids=[c[0] for c in PARQUET_CASES])
def test_bad_parquet_file(tmp_path, name, columns, message):
    folder = tmp_path / "in"
    folder.mkdir()
    path = folder / "log.parquet"
    pq.write_table(pa.table(columns), path)
    _refused(tmp_path, path, None, message)


def test_not_parquet_at_all(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    path = folder / "log.parquet"
    path.write_bytes(b"PAR1 but not really")
    _refused(tmp_path, path, "parquet", r": not a readable Parquet file")
