"""Every reader on every shared recommendation dataset: counts match PROVENANCE.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bft_lightning.datamodules.readers import read_interactions, read_json, read_recbole
from bft_lightning.datamodules.registry import KNOWN_DATASETS, resolve_dataset

# folder, file, format, users, items, interactions (from each PROVENANCE.md)
CASES = [
    ("amazon-beauty-s3rec", "Beauty.txt", "s3rec", 22363, 12101, 198502),
    ("amazon-sports-s3rec", "Sports_and_Outdoors.txt", "s3rec", 35598, 18357, 296337),
    ("amazon-toys-s3rec", "Toys_and_Games.txt", "s3rec", 19412, 11924, 167597),
    ("yelp-s3rec", "Yelp.txt", "s3rec", 30431, 20033, 316354),
    ("lastfm-s3rec", "LastFM.txt", "s3rec", 1090, 3646, 52551),
    ("amazon-beauty-bert4rec", "beauty.txt", "pairs", 40226, 54542, 353962),
    ("amazon-instruments-lcrec", "Instruments.inter.json", "json", 24772, 9922, 206153),
    ("amazon-instruments-mql4grec", "Instruments.inter.json", "json", 17112, 6250, 136226),
    ("amazon-instruments-mql4grec", "Instruments.test.inter", "recbole", 17112, 6250, 136226),
]
COUNTS = re.compile(r"users: ([\d,]+); items[^:]*: ([\d,]+); interactions: ([\d,]+)")


def _provenance_counts(folder: Path) -> tuple[int, int, int]:
    """The (users, items, interactions) line of a PROVENANCE.md."""
    match = COUNTS.search((folder / "PROVENANCE.md").read_text(encoding="utf-8"))
    assert match is not None, f"no counts line in {folder}/PROVENANCE.md"
    users, items, inter = (int(g.replace(",", "")) for g in match.groups())
    return users, items, inter


@pytest.mark.parametrize("folder,name,fmt,users,items,inter", CASES)
def test_counts_match_provenance(data_root, folder, name, fmt, users, items, inter):
    path = data_root / folder / name
    if not path.is_file():
        pytest.skip(f"{path} not present")
    assert _provenance_counts(data_root / folder) == (users, items, inter)
    log = read_interactions(path, fmt)
    assert (log.num_users, log.num_items, log.num_interactions) == (users, items, inter)
    assert min(len(s) for s in log.sequences) == 5  # all shared sets are 5-core users


@pytest.mark.parametrize("folder,name,fmt", [c[:3] for c in CASES if c[2] != "recbole"])
def test_registry_finds_file_and_format(data_root, folder, name, fmt):
    if not (data_root / folder).is_dir():
        pytest.skip(f"{folder} not present")
    assert folder in KNOWN_DATASETS
    assert resolve_dataset(folder, data_root) == (data_root / folder / name, fmt)


def test_recbole_splits_rebuild_the_json_sequences(data_root):
    folder = data_root / "amazon-instruments-mql4grec"
    if not folder.is_dir():
        pytest.skip("amazon-instruments-mql4grec not present")
    from_json = read_json(folder / "Instruments.inter.json")
    from_splits = read_recbole(folder / "Instruments.train.inter")
    assert [str(u) for u in from_json.users] == from_splits.users
    assert [[str(i) for i in s] for s in from_json.sequences] == from_splits.sequences
    assert max(len(s) for s in from_splits.sequences) == 131  # longer than the 50-item window


def test_yelp_repeats_are_kept(data_root):
    path = data_root / "yelp-s3rec" / "Yelp.txt"
    if not path.is_file():
        pytest.skip("yelp-s3rec not present")
    log = read_interactions(path, "s3rec")
    repeats = sum(len(s) - len(set(s)) for s in log.sequences)
    assert repeats == 11830  # PROVENANCE.md: 11,830 repeated interactions
