"""Processed-data cache: remapped sequences stored as memory-mapped ``.npy`` arrays.

A cache entry is a folder holding one :class:`~.splits.SequenceData`: one
``.npy`` file per array (``items``, ``offsets``, ``user_ids``, ``item_ids``,
and ``times`` when the file has timestamps) and ``meta.json`` with the key.
The key is the sha256 of the source file(s) plus the preprocessing options
(format, k-core) and :data:`CACHE_VERSION`; the folder name carries the first
16 hex digits of the key and the full key is checked on load, so a cache built
from another file or other options is never read.

Loading memory-maps the arrays (``np.load(mmap_mode="r")``): opening a cache
of 20M interactions takes milliseconds, and every process on a host (DDP
ranks, DataLoader workers) shares the same pages of the page cache instead of
holding its own copy. The arrays are read-only.

Writes are atomic: the arrays go to a temporary ``.tmp-*`` folder in the
cache folder, each file flushed and fsync'ed, ``meta.json`` last; the folder
is then renamed to its final name. Loading only opens the exact final name,
so a half-written temporary folder (a killed writer) is never picked; a final
entry that cannot be read is ignored (with a warning) and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .readers import read_interactions, sniff_format
from .splits import SequenceData, encode

__all__ = [
    "CACHE_VERSION",
    "cache_key",
    "cache_path",
    "file_sha256",
    "load_cached",
    "load_sequences",
    "save_cached",
    "source_files",
]

CACHE_VERSION = 4  # 2: readers strip ids, reject empty ones, read 2014 Amazon CSVs and BOMs;
# 3: fractional timestamps order by their exact value, ids are ASCII digits;
# 4: a folder of memory-mapped .npy arrays (was one .npz)
_SPLIT_SUFFIXES = (".train.inter", ".valid.inter", ".test.inter")


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_files(path: str | Path) -> list[Path]:
    """The files a read of ``path`` depends on (three for RecBole split files)."""
    path = Path(path)
    for suffix in _SPLIT_SUFFIXES:
        if path.name.endswith(suffix):
            stem = path.name.removesuffix(suffix)
            return [path.with_name(stem + s) for s in _SPLIT_SUFFIXES]
    return [path]


def cache_key(files: list[Path], options: dict[str, object]) -> str:
    """sha256 over the files' sha256s, the options and the cache version."""
    payload = {
        "version": CACHE_VERSION,
        "files": [file_sha256(f) for f in files],
        "options": options,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: str | Path, stem: str, key: str) -> Path:
    """``<cache_dir>/<stem>-<key[:16]>`` (a folder)."""
    return Path(cache_dir) / f"{stem}-{key[:16]}"


_ARRAYS = ("items", "offsets", "user_ids", "item_ids", "times")


def _write_npy(folder: Path, name: str, array: np.ndarray) -> None:
    with open(folder / f"{name}.npy", "wb") as fh:
        np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())


def save_cached(path: Path, data: SequenceData, key: str) -> None:
    """Write ``data`` to the folder ``path`` atomically (temp folder + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent))
    try:
        for name in _ARRAYS:
            array = getattr(data, name)
            if array is not None:
                _write_npy(tmp, name, array)
        meta = {"key": key, "version": CACHE_VERSION, "num_items": data.num_items}
        with open(tmp / "meta.json", "w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        old = None
        if path.exists():  # a damaged entry being rebuilt: move it aside first
            old = Path(tempfile.mkdtemp(prefix=".old-", dir=path.parent))
            os.replace(path, old / "entry")
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_cached(path: Path, key: str) -> SequenceData | None:
    """The cached data at ``path`` (memory-mapped) if it is readable and has ``key``."""
    if not path.exists():
        return None
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("key") != key:
            return None
        arrays = {
            name: np.load(path / f"{name}.npy", mmap_mode="r", allow_pickle=False)
            for name in _ARRAYS
            if name != "times" or (path / "times.npy").exists()
        }
        data = SequenceData(
            items=arrays["items"],
            offsets=arrays["offsets"],
            times=arrays.get("times"),
            num_items=len(arrays["item_ids"]) - 1,
            user_ids=arrays["user_ids"],
            item_ids=arrays["item_ids"],
        )
        _check_shapes(data, int(meta["num_items"]))
        return data
    except Exception as err:  # a damaged cache is rebuilt, never trusted
        warnings.warn(f"ignoring unreadable cache {path}: {err}", stacklevel=2)
        return None


def _check_shapes(data: SequenceData, num_items: int) -> None:
    """Raise unless the arrays fit together (a damaged entry)."""
    ok = (
        data.num_items == num_items
        and len(data.user_ids) == len(data.offsets) - 1
        and int(data.offsets[-1]) == len(data.items)
        and (data.times is None or len(data.times) == len(data.items))
    )
    if not ok:
        raise ValueError("arrays of inconsistent shapes")


def load_sequences(
    path: str | Path,
    format: str | None = None,
    kcore: int | None = None,
    cache_dir: str | Path | None = None,
    validate: Callable[[SequenceData], None] | None = None,
) -> SequenceData:
    """Read and remap ``path``, through the ``.npy`` cache when ``cache_dir`` is set.

    ``validate`` (raising on data that cannot be used) runs before the cache is
    written, so unusable data leaves no cache file behind.
    """
    check = validate or (lambda data: None)
    if cache_dir is None:
        data = encode(read_interactions(path, format, kcore))
        check(data)
        return data
    path = Path(path)
    format = format or sniff_format(path)
    key = cache_key(source_files(path), {"format": format, "kcore": kcore})
    target = cache_path(cache_dir, path.name, key)
    cached = load_cached(target, key)
    if cached is not None:
        check(cached)
        return cached
    data = encode(read_interactions(path, format, kcore))
    check(data)
    save_cached(target, data, key)
    return data
