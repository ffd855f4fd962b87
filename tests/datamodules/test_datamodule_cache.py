"""The processed ``.npy`` cache: atomic writes, memory maps, reuse, invalidation, damage."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bft_lightning.datamodules import cache as cache_mod
from bft_lightning.datamodules.cache import cache_key, cache_path, load_cached, load_sequences

TEXT = "1 5 3 5\n2 7 8 9\n3 3 7 8\n"


def _no_reading(monkeypatch):
    """Make any parse fail, so a successful load must come from the cache."""

    def boom(*args, **kwargs):
        raise AssertionError("source was parsed although a valid cache exists")

    monkeypatch.setattr(cache_mod, "read_interactions", boom)


def _npz(folder):
    return sorted(p.name for p in folder.iterdir())


def _stored(entry, name):
    return np.load(entry / f"{name}.npy")


def test_written_once_then_read(write, tmp_path, monkeypatch):
    src, cache_dir = write("d.txt", TEXT), tmp_path / "cache"
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(
        cache_mod.os, "replace", lambda a, b: (replaced.append((a, b)), real_replace(a, b))
    )
    first = load_sequences(src, "s3rec", 0, cache_dir)
    assert len(replaced) == 1 and os.path.basename(replaced[0][0]).startswith(".tmp-")
    assert _npz(cache_dir) == [os.path.basename(replaced[0][1])]  # no temp file left
    _no_reading(monkeypatch)
    second = load_sequences(src, "s3rec", 0, cache_dir)
    assert np.array_equal(first.items, second.items) and np.array_equal(
        first.offsets, second.offsets
    )
    assert second.num_items == first.num_items == 5 and second.times is None
    assert second.item_ids.tolist() == first.item_ids.tolist()
    assert isinstance(second.items, np.memmap) and not second.items.flags.writeable


def test_entry_is_memory_mapped_and_shared(write, tmp_path):
    src, cache_dir = (
        write("ratings.dat", "1::10::5::300\n1::11::3::100\n2::10::1::5\n"),
        tmp_path / "c",
    )
    first = load_sequences(src, None, 0, cache_dir)
    again = load_sequences(src, None, 0, cache_dir)
    for name in ("items", "offsets", "times", "user_ids", "item_ids"):
        mapped = getattr(again, name)
        assert isinstance(mapped, np.memmap), name  # pages shared, not copied
        assert mapped.tolist() == getattr(first, name).tolist()
    (entry,) = cache_dir.iterdir()
    assert sorted(p.name for p in entry.iterdir()) == [
        "item_ids.npy", "items.npy", "meta.json", "offsets.npy", "times.npy", "user_ids.npy",
    ]  # fmt: skip


def test_timestamps_round_trip(write, tmp_path, monkeypatch):
    src = write("ratings.dat", "1::10::5::300\n1::11::3::100\n")
    first = load_sequences(src, None, 0, tmp_path / "c")
    _no_reading(monkeypatch)
    assert (
        load_sequences(src, None, 0, tmp_path / "c").times.tolist()
        == first.times.tolist()
        == [100, 300]
    )


def test_options_and_content_change_the_key(write, tmp_path):
    src, cache_dir = write("d.txt", TEXT), tmp_path / "cache"
    load_sequences(src, "s3rec", 0, cache_dir)
    load_sequences(src, "s3rec", 3, cache_dir)
    assert len(_npz(cache_dir)) == 2
    src.write_text(TEXT + "4 1 2\n")
    data = load_sequences(src, "s3rec", 0, cache_dir)
    assert data.num_users == 4 and len(_npz(cache_dir)) == 3


def test_wrong_key_inside_is_never_read(write, tmp_path):
    src, cache_dir = write("d.txt", TEXT), tmp_path / "cache"
    load_sequences(src, "s3rec", 0, cache_dir)
    key = cache_key([src], {"format": "s3rec", "kcore": 0})
    stored = cache_path(cache_dir, src.name, key)
    assert load_cached(stored, key) is not None
    assert load_cached(stored, "0" * 64) is None


def test_half_written_temp_file_is_ignored(write, tmp_path):
    src, cache_dir = write("d.txt", TEXT), tmp_path / "cache"
    cache_dir.mkdir()
    key = cache_key([src], {"format": "s3rec", "kcore": 0})
    final = cache_path(cache_dir, src.name, key)
    killed = cache_dir / f".tmp-abc{final.name}"  # a writer killed half way
    killed.mkdir()
    (killed / "items.npy").write_bytes(b"\x93NUMPY half written")
    assert load_sequences(src, "s3rec", 0, cache_dir).num_users == 3
    assert json.loads((final / "meta.json").read_text())["key"] == key


def test_corrupted_final_file_is_rebuilt(write, tmp_path):
    src, cache_dir = write("d.txt", TEXT), tmp_path / "cache"
    load_sequences(src, "s3rec", 0, cache_dir)
    (final,) = cache_dir.iterdir()
    items = final / "items.npy"
    items.write_bytes(items.read_bytes()[:100])
    with pytest.warns(UserWarning, match="ignoring unreadable cache"):
        assert load_sequences(src, "s3rec", 0, cache_dir).num_users == 3
    assert _stored(final, "items").tolist() == [1, 2, 1, 3, 4, 5, 2, 3, 4]
    assert [p.name for p in cache_dir.iterdir()] == [final.name]  # nothing else left


def test_failed_write_leaves_nothing(write, tmp_path, monkeypatch):
    src, cache_dir = write("d.txt", TEXT), tmp_path / "cache"

    def broken_save(fh, array, allow_pickle=False):
        fh.write(b"\x93NUMPY partial")
        raise OSError("disk full")

    monkeypatch.setattr(cache_mod.np, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        load_sequences(src, "s3rec", 0, cache_dir)
    assert _npz(cache_dir) == []
