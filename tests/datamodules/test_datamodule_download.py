"""Downloads, with no network: a monkeypatched urlopen and local file:// URLs."""

from __future__ import annotations

import hashlib
import http.client
import io
import re
import urllib.error
import zipfile

import pytest

from bft_lightning.datamodules import download as dl
from bft_lightning.datamodules.download import (
    DownloadError,
    RemoteFile,
    amazon_remote,
    download_file,
    ensure_movielens_1m,
)
from bft_lightning.datamodules.readers import read_movielens
from bft_lightning.datamodules.registry import resolve_dataset


@pytest.fixture()
def offline(monkeypatch):
    """urlopen fails like a machine without DNS; records the timeout it got."""
    seen = {}

    def fail(url, timeout=None):
        seen["timeout"] = timeout
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(dl, "urlopen", fail)
    return seen


def test_offline_names_url_and_target(tmp_path, offline):
    with pytest.raises(DownloadError) as info:
        ensure_movielens_1m(tmp_path / "ml-1m")
    message = str(info.value)
    assert "https://files.grouplens.org/datasets/movielens/ml-1m.zip" in message
    assert str(tmp_path / "ml-1m" / "ml-1m.zip") in message
    assert str(tmp_path / "ml-1m" / "ratings.dat") in message
    assert 0 < offline["timeout"] <= 30  # fails fast
    assert list((tmp_path / "ml-1m").iterdir()) == []


def test_registry_download_offline_and_hint(tmp_path, offline):
    with pytest.raises(DownloadError, match=re.escape(amazon_remote("Beauty", 2014).url)):
        resolve_dataset("amazon2014-Beauty", tmp_path, download=True)
    with pytest.raises(FileNotFoundError, match=r"download=True"):
        resolve_dataset("amazon2018-Musical_Instruments", tmp_path, download=False)


def test_amazon_urls():
    assert amazon_remote("Beauty", 2014).url == (
        "http://snap.stanford.edu/data/amazon/productGraph/categoryFiles/reviews_Beauty_5.json.gz"
    )
    assert amazon_remote("Musical_Instruments", 2018).url == (
        "https://datarepo.eng.ucsd.edu/mcauley_group/data/amazon_v2/"
        "categoryFilesSmall/Musical_Instruments_5.json.gz"
    )
    with pytest.raises(ValueError, match="year"):
        amazon_remote("Beauty", 2023)


def _local(tmp_path, payload: bytes, sha256: str | None) -> RemoteFile:
    src = tmp_path / "server" / "file.bin"
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(payload)
    return RemoteFile(src.as_uri(), "file.bin", sha256)


def test_file_url_with_checksum(tmp_path, monkeypatch):
    payload = b"some bytes\n" * 1000
    remote = _local(tmp_path, payload, hashlib.sha256(payload).hexdigest())
    target = download_file(remote, tmp_path / "out")
    assert target.read_bytes() == payload and [p.name for p in target.parent.iterdir()] == [
        "file.bin"
    ]
    monkeypatch.setattr(dl, "urlopen", None)  # present: no second fetch
    assert download_file(remote, tmp_path / "out") == target


def test_checksum_mismatch_leaves_nothing(tmp_path):
    remote = _local(tmp_path, b"tampered", "0" * 64)
    with pytest.raises(DownloadError, match="sha256 mismatch"):
        download_file(remote, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_movielens_zip_is_extracted(tmp_path):
    archive = tmp_path / "server" / "ml-1m.zip"
    archive.parent.mkdir()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("ml-1m/README", "readme")
        zf.writestr("ml-1m/ratings.dat", "1::10::5::300\n1::11::3::100\n")
    remote = RemoteFile(archive.as_uri(), "ml-1m.zip")
    ratings = ensure_movielens_1m(tmp_path / "data" / "ml-1m", remote)
    assert ratings == tmp_path / "data" / "ml-1m" / "ratings.dat"
    assert read_movielens(ratings).sequences == [[11, 10]]
    assert resolve_dataset("ml-1m", tmp_path / "data") == (ratings, "movielens")


def _movielens_zip(path, compression=zipfile.ZIP_STORED) -> bytes:
    """Write a small valid ml-1m.zip at ``path``; returns the ratings.dat payload."""
    payload = b"1::10::5::300\n1::11::3::100\n" * 50
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        zf.writestr("ml-1m/ratings.dat", payload)
    return payload


def _flip_member_bytes(path, payload: bytes) -> None:
    """Corrupt the stored member data in place (the zip structure stays readable)."""
    data = bytearray(path.read_bytes())
    start = data.index(payload)
    for i in range(start + 5, start + 15):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _assert_removed_and_clean(root, info) -> None:
    archive = root / "ml-1m.zip"
    message = str(info.value)
    assert str(archive) in message and "removed" in message
    assert str(root / "ratings.dat") in message
    assert list(root.iterdir()) == []  # no archive, no .tmp-* leftovers, no ratings.dat


def test_movielens_bad_crc_removes_archive_and_temp(tmp_path):
    root = tmp_path / "ml-1m"
    payload = _movielens_zip(root / "ml-1m.zip")
    _flip_member_bytes(root / "ml-1m.zip", payload)
    with pytest.raises(DownloadError) as info:
        ensure_movielens_1m(root, RemoteFile("file:///nonexistent/ml-1m.zip", "ml-1m.zip"))
    _assert_removed_and_clean(root, info)


def test_movielens_broken_deflate_removes_archive(tmp_path):
    root = tmp_path / "ml-1m"
    archive = root / "ml-1m.zip"
    _movielens_zip(archive, zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(archive) as zf:
        info_ = zf.getinfo("ml-1m/ratings.dat")
        start = info_.header_offset + 30 + len(info_.filename) + len(info_.extra)
        size = info_.compress_size
    data = bytearray(archive.read_bytes())
    data[start : start + size] = bytes(b ^ 0x5A for b in data[start : start + size])
    archive.write_bytes(bytes(data))
    with pytest.raises(DownloadError) as info:
        ensure_movielens_1m(root, RemoteFile("file:///nonexistent/ml-1m.zip", "ml-1m.zip"))
    _assert_removed_and_clean(root, info)


def test_movielens_not_a_zip_names_archive(tmp_path):
    root = tmp_path / "ml-1m"
    root.mkdir()
    (root / "ml-1m.zip").write_bytes(b"<html>404 Not Found</html>\n")
    with pytest.raises(DownloadError) as info:
        ensure_movielens_1m(root, RemoteFile("file:///nonexistent/ml-1m.zip", "ml-1m.zip"))
    _assert_removed_and_clean(root, info)


def test_movielens_corrupt_download_is_fetched_again(tmp_path):
    server = tmp_path / "server" / "ml-1m.zip"
    payload = _movielens_zip(server)
    good = server.read_bytes()
    _flip_member_bytes(server, payload)
    remote = RemoteFile(server.as_uri(), "ml-1m.zip")
    root = tmp_path / "data" / "ml-1m"
    with pytest.raises(DownloadError, match="removed"):
        ensure_movielens_1m(root, remote)
    assert list(root.iterdir()) == []
    server.write_bytes(good)
    ratings = ensure_movielens_1m(root, remote)
    assert ratings.read_bytes() == payload
    assert sorted(p.name for p in root.iterdir()) == ["ml-1m.zip", "ratings.dat"]


class _BrokenResponse(io.BytesIO):
    """A response whose connection closes after the first chunk."""

    def read(self, size=-1):
        if self.tell() == 0:
            return super().read(4)
        raise http.client.IncompleteRead(b"", 100)


def test_incomplete_read_names_url_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(dl, "urlopen", lambda url, timeout=None: _BrokenResponse(b"x" * 64))
    remote = RemoteFile("https://example.invalid/data.bin", "data.bin")
    with pytest.raises(DownloadError) as info:
        download_file(remote, tmp_path / "out")
    assert remote.url in str(info.value)
    assert str(tmp_path / "out" / "data.bin") in str(info.value)
    assert list((tmp_path / "out").iterdir()) == []
