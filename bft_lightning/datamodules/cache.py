"""Processed-data cache: remapped sequences stored as ``.npz``.

A cache file holds one :class:`~.splits.SequenceData`. Its key is the sha256
of the source file(s) plus the preprocessing options (format, k-core) and
:data:`CACHE_VERSION`; the file name carries the first 16 hex digits of the
key and the full key is stored inside and checked on load, so a cache built
from another file or other options is never read.

Writes are atomic: the arrays go to a temporary ``.tmp-*`` file in the cache
folder, are flushed and fsync'ed, and are then renamed with ``os.replace``.
Loading only opens the exact final name, so a half-written temporary file is
never picked; a final file that cannot be read is ignored (with a warning)
and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

CACHE_VERSION = 3  # 2: readers strip ids, reject empty ones, read 2014 Amazon CSVs and BOMs;
# 3: fractional timestamps order by their exact value, ids are ASCII digits
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
    """``<cache_dir>/<stem>-<key[:16]>.npz``."""
    return Path(cache_dir) / f"{stem}-{key[:16]}.npz"


def save_cached(path: Path, data: SequenceData, key: str) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same folder + rename)."""
    arrays: dict[str, Any] = {
        "key": np.array(key),
        "items": data.items,
        "offsets": data.offsets,
        "user_ids": data.user_ids,
        "item_ids": data.item_ids,
    }
    if data.times is not None:
        arrays["times"] = data.times
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_cached(path: Path, key: str) -> SequenceData | None:
    """The cached data at ``path`` if it exists, is readable and has ``key``."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) != key:
                return None
            times = z["times"] if "times" in z.files else None
            return SequenceData(
                items=z["items"],
                offsets=z["offsets"],
                times=times,
                num_items=len(z["item_ids"]) - 1,
                user_ids=z["user_ids"],
                item_ids=z["item_ids"],
            )
    except Exception as err:  # a damaged cache is rebuilt, never trusted
        warnings.warn(f"ignoring unreadable cache {path}: {err}", stacklevel=2)
        return None


def load_sequences(
    path: str | Path,
    format: str | None = None,
    kcore: int | None = None,
    cache_dir: str | Path | None = None,
    validate: Callable[[SequenceData], None] | None = None,
) -> SequenceData:
    """Read and remap ``path``, through the ``.npz`` cache when ``cache_dir`` is set.

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
