"""Opt-in downloads (``download=True``) of public recommendation datasets.

Known sources: MovieLens-1M (GroupLens zip, ``ratings.dat`` is extracted) and
the Amazon review "5-core" category files of 2014 (SNAP) and 2018 (UCSD).
A download streams into a temporary file next to the target, checks the
sha256 when one is known, and is renamed into place only when complete, so
a failed or mismatched download leaves nothing behind. A MovieLens archive
that turns out to be corrupt is deleted, so the next run downloads it again.

Offline, a download fails fast (``timeout`` seconds, default 10) with a
:class:`DownloadError` that names the URL and the path where the file can be
placed by hand. MovieLens may not be redistributed (GroupLens license), so
it is never shipped with this package.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import BinaryIO
from urllib.request import urlopen

__all__ = [
    "MOVIELENS_1M",
    "DownloadError",
    "RemoteFile",
    "amazon_remote",
    "download_file",
    "ensure_amazon",
    "ensure_movielens_1m",
]

_AMAZON_URLS = {
    2014: "http://snap.stanford.edu/data/amazon/productGraph/categoryFiles/reviews_{}_5.json.gz",
    2018: "https://datarepo.eng.ucsd.edu/mcauley_group/data/amazon_v2/categoryFilesSmall/{}_5.json.gz",
}


class DownloadError(RuntimeError):
    """A download failed; the message names the URL and the manual target path."""


@dataclass(frozen=True)
class RemoteFile:
    """A file to fetch: its URL, local file name and sha256 (``None`` = unchecked)."""

    url: str
    filename: str
    sha256: str | None = None


MOVIELENS_1M = RemoteFile("https://files.grouplens.org/datasets/movielens/ml-1m.zip", "ml-1m.zip")


def amazon_remote(category: str, year: int = 2014) -> RemoteFile:
    """The 5-core review file of an Amazon ``category`` (e.g. ``"Beauty"``) for 2014/2018."""
    if year not in _AMAZON_URLS:
        raise ValueError(f"Amazon review year must be one of {sorted(_AMAZON_URLS)}, got {year}")
    url = _AMAZON_URLS[year].format(category)
    return RemoteFile(url, url.rsplit("/", 1)[-1])


def _copy_hashing(src: BinaryIO, dst: BinaryIO) -> str:
    """Copy a binary stream to ``dst`` and return the sha256 of the bytes."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: src.read(1 << 20), b""):
        digest.update(chunk)
        dst.write(chunk)
    return digest.hexdigest()


def download_file(remote: RemoteFile, dest_dir: str | Path, timeout: float = 10.0) -> Path:
    """Fetch ``remote`` into ``dest_dir`` (skipped when the file is already there).

    Raises :class:`DownloadError` when the URL cannot be read or the transfer
    breaks off (naming the URL and the path to fill by hand) or when the
    sha256 does not match; in every case the partial file is removed.
    """
    target = Path(dest_dir) / remote.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with urlopen(remote.url, timeout=timeout) as response:
                    digest = _copy_hashing(response, out)
            # URLError, timeouts and socket errors are OSErrors; a connection closed
            # early raises HTTPException (IncompleteRead); a bad URL a ValueError.
            except (OSError, HTTPException, ValueError) as err:
                raise DownloadError(_offline_message(remote, target, err)) from err
        _check_sha256(remote, digest)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def _offline_message(remote: RemoteFile, target: Path, err: BaseException) -> str:
    """How to get the file by hand when the download failed."""
    return (
        f"could not download {remote.url} ({err}). Without internet access, fetch it "
        f"elsewhere and place it at {target}, then run again."
    )


def _check_sha256(remote: RemoteFile, digest: str) -> None:
    """Raise :class:`DownloadError` when a known checksum does not match."""
    if remote.sha256 is not None and digest != remote.sha256:
        raise DownloadError(
            f"sha256 mismatch for {remote.url}: expected {remote.sha256}, got {digest}; "
            "the file was not kept"
        )


def ensure_movielens_1m(
    root: str | Path, remote: RemoteFile = MOVIELENS_1M, timeout: float = 10.0
) -> Path:
    """``<root>/ratings.dat`` of MovieLens-1M, downloading and extracting if needed."""
    root = Path(root)
    ratings = root / "ratings.dat"
    if ratings.is_file():
        return ratings
    try:
        archive = download_file(remote, root, timeout)
    except DownloadError as err:
        raise DownloadError(f"{err} (or put the extracted ratings.dat at {ratings})") from err
    _extract_ratings(archive, ratings)
    return ratings


def _extract_ratings(archive: Path, ratings: Path) -> None:
    """Extract the ``ratings.dat`` member of ``archive`` to ``ratings`` atomically.

    A corrupt archive (not a zip, bad CRC, broken compressed data) is deleted,
    so the next run downloads it again, and :class:`DownloadError` names it.
    """
    tmp: str | None = None
    try:
        with zipfile.ZipFile(archive) as zf:
            member = next((n for n in zf.namelist() if n.endswith("ratings.dat")), None)
            if member is None:
                raise DownloadError(f"{archive} has no ratings.dat; place it at {ratings} by hand")
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".dat", dir=ratings.parent)
            with zf.open(member) as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, ratings)
            tmp = None
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        archive.unlink(missing_ok=True)
        raise DownloadError(
            f"{archive} is not a valid zip archive ({err}); it was removed, so the next "
            f"run downloads it again (or put the extracted ratings.dat at {ratings})"
        ) from err
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def ensure_amazon(root: str | Path, category: str, year: int = 2014, timeout: float = 10.0) -> Path:
    """The Amazon 5-core review file for ``category`` under ``root``, downloading if needed."""
    return download_file(amazon_remote(category, year), root, timeout)
