"""Bad inputs raise errors that name the file, the line and what is wrong."""

from __future__ import annotations

import re

import pytest

from bft_lightning.datamodules.readers import read_interactions

BAD = [
    # format, file name, content, expected message fragment (after "<file>:")
    ("s3rec", "s.txt", "1 2 3\n2 x 4\n", r":2: non-integer item id 'x'"),
    ("s3rec", "s.txt", "1 2 3\nu 4\n", r":2: non-integer user id 'u'"),
    ("s3rec", "s.txt", "1 2 3\n2 -4\n", r":2: negative item id -4"),
    # int() takes these, which would merge them with 10 and 12
    ("s3rec", "s.txt", "1 2 3\n2 1_0\n", r":2: non-integer item id '1_0'"),
    ("pairs", "p.txt", "1 2\n1 \uff11\uff12\n", r":2: non-integer item id '\uff11\uff12'"),
    ("json", "j.json", '{"\u00b2": [1]}', r"user '\u00b2': user key is not a non-negative"),
    ("s3rec", "s.txt", "1 2 3\n\n7\n", r":3: expected 'user item1"),
    ("s3rec", "s.txt", "1 2 3\n1 4\n", r":2: user 1 already listed on line 1"),
    ("pairs", "p.txt", "1 2\n1 2 3\n", r":2: expected 2 fields"),
    ("pairs", "p.txt", "1 2\n1 2.5\n", r":2: non-integer item id '2.5'"),
    ("json", "j.json", '{"0": [1, 2],\n "1": [3,, 4]}', r":2: broken JSON"),
    ("json", "j.json", '{"0": [1, "a"]}', r"user '0', position 1: non-integer item id 'a'"),
    ("json", "j.json", '{"0": [1, -2]}', r"position 1: negative item id -2"),
    ("json", "j.json", '{"x": [1]}', r"user 'x': user key is not a non-negative integer"),
    ("json", "j.json", '{"0": []}', r"user '0': expected a non-empty list"),
    ("json", "j.json", "[1, 2]", r"expected a JSON object"),
    ("json", "j.json", '{"3": [1, 2],\n "3": [5]}', r"user '3': user 3 appears twice"),
    ("json", "j.json", '{"3": [1, 2], "03": [5]}', r"user '03': user 3 appears twice"),
    (
        "recbole",
        "r.inter",
        "user_id:token\titem_id:token\ttimestamp:float\n1\t2\t4\n1\t\t5\n",
        r":3: item_id: empty id",
    ),
    (
        "recbole",
        "r.inter",
        "item_id:token\tuser_id:token\ttimestamp:float\n2\t \t5\n",
        r":2: user_id: empty id",
    ),
    (
        "recbole",
        "r.inter",
        "user_id:token\titem_id:token\n1\t2\n3\n",
        r":3: expected 2 tab-separated",
    ),
    ("recbole", "r.inter", "user\titem\n1\t2\n", r":1: expected a RecBole header"),
    ("recbole", "r.inter", "user_id:token\tx:token\n1\t2\n", r":1: header lacks user_id/item_id"),
    (
        "recbole",
        "r.inter",
        "user_id:token\titem_id:token\ttimestamp:float\n1\t2\tsoon\n",
        r":2: non-numeric timestamp 'soon'",
    ),
    ("movielens", "ratings.dat", "1::2::5::9\n1::2::5\n", r":2: expected 4 fields"),
    ("movielens", "u.data", "1\t2\t5\t9\n1\tb\t5\t9\n", r":2: non-integer item id 'b'"),
    (
        "amazon",
        "a.json",
        '{"reviewerID": "u", "asin": "i", "unixReviewTime": 1}\n{"reviewerID": "u"',
        r":2: broken JSON",
    ),
    (
        "amazon",
        "a.json",
        '{"reviewerID": "u", "unixReviewTime": 1}\n',
        r":1: missing key\(s\) \['asin'\]",
    ),
    (
        "amazon",
        "a.json",
        '{"reviewerID": "u", "asin": "i", "unixReviewTime": 1}\n'
        '{"reviewerID": null, "asin": "i", "unixReviewTime": 2}\n',
        r":2: reviewerID: expected a string or integer id, got None",
    ),
    (
        "amazon",
        "a.json",
        '{"reviewerID": "u", "asin": " ", "unixReviewTime": 1}\n',
        r":1: asin: empty id",
    ),
    ("amazon", "a.csv", "i,u,5,1\ni,,5,2\n", r":2: user: empty id"),
    ("amazon", "a.csv", "item,user,rating,timestamp\n,u,5,2\n", r":2: item: empty id"),
    ("amazon", "a.csv", "i,u,5,1\ni,u,5\n", r":2: expected 4 comma-separated fields"),
    ("amazon", "a.csv", "i,u,5,1\ni,u,5,later\n", r":2: non-numeric timestamp 'later'"),
]


@pytest.mark.parametrize("fmt,name,text,message", BAD)
def test_bad_line_names_file_and_line(write, fmt, name, text, message):
    path = write(name, text)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + message):
        read_interactions(path, fmt, kcore=0)


@pytest.mark.parametrize("fmt", ["s3rec", "pairs", "json", "recbole", "movielens", "amazon"])
@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_file(write, fmt, text):
    path = write("empty.txt", text)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*empty file"):
        read_interactions(path, fmt)


@pytest.mark.parametrize("fmt", ["s3rec", "pairs", "json", "recbole", "movielens", "amazon", None])
def test_missing_file(tmp_path, fmt):
    path = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        read_interactions(path, fmt)


def test_unknown_format(write):
    path = write("s.txt", "1 2 3\n")
    with pytest.raises(ValueError, match=r"unknown format 'csv'.*known: \['amazon'"):
        read_interactions(path, "csv")


def test_broken_gzip(write, tmp_path):
    path = tmp_path / "reviews.json.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": cannot read file"):
        read_interactions(path, "amazon")


def test_recbole_split_missing_sibling(write, tmp_path):
    write("X.train.inter", "user_id:token\titem_id_list:token_seq\titem_id:token\n0\t1\t2\n")
    with pytest.raises(FileNotFoundError, match="X.valid.inter"):
        read_interactions(tmp_path / "X.train.inter", "recbole")
