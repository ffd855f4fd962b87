"""Dataset names -> (file, format), and ``download=True`` for the public ones.

Names:

- the folders of the shared data (``amazon-beauty-s3rec``, ``yelp-s3rec``, ...),
  see :data:`KNOWN_DATASETS`;
- ``ml-1m`` (``<data_root>/ml-1m/ratings.dat``, downloadable) and ``ml-100k``
  (``<data_root>/ml-100k/u.data``);
- ``amazon2014-<Category>`` / ``amazon2018-<Category>`` (e.g. ``amazon2014-Beauty``,
  ``amazon2018-Musical_Instruments``): the 5-core review file, downloadable;
- any other folder under ``data_root`` that holds exactly one interaction
  file, whose format is sniffed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .download import amazon_remote, ensure_amazon, ensure_movielens_1m
from .readers import sniff_format

DATA_ROOT_ENV = "BFT_DATA_ROOT"


def default_data_root() -> Path:
    """The data root when none is given: ``$BFT_DATA_ROOT``, else ``data`` (working directory)."""
    return Path(os.environ.get(DATA_ROOT_ENV, "data")).expanduser()


__all__ = ["KNOWN_DATASETS", "DatasetSpec", "resolve_dataset"]


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset's interactions live inside its folder, and how to read them."""

    filename: str
    format: str
    fetch: Callable[[Path], Path] | None = None


KNOWN_DATASETS: dict[str, DatasetSpec] = {
    "amazon-beauty-s3rec": DatasetSpec("Beauty.txt", "s3rec"),
    "amazon-sports-s3rec": DatasetSpec("Sports_and_Outdoors.txt", "s3rec"),
    "amazon-toys-s3rec": DatasetSpec("Toys_and_Games.txt", "s3rec"),
    "yelp-s3rec": DatasetSpec("Yelp.txt", "s3rec"),
    "lastfm-s3rec": DatasetSpec("LastFM.txt", "s3rec"),
    "amazon-beauty-bert4rec": DatasetSpec("beauty.txt", "pairs"),
    "amazon-instruments-lcrec": DatasetSpec("Instruments.inter.json", "json"),
    "amazon-instruments-mql4grec": DatasetSpec("Instruments.inter.json", "json"),
    "ml-1m": DatasetSpec("ratings.dat", "movielens", ensure_movielens_1m),
    "ml-100k": DatasetSpec("u.data", "movielens"),
}

_AMAZON_NAME = re.compile(r"amazon(2014|2018)-(\w+)")
_NOT_INTERACTIONS = re.compile(r"(PROVENANCE|README|item2attributes|_sample|2id$|\.md$|\.zip$)")


def _spec(name: str) -> DatasetSpec | None:
    """The spec of a known or pattern-named dataset, else ``None``."""
    if name in KNOWN_DATASETS:
        return KNOWN_DATASETS[name]
    match = _AMAZON_NAME.fullmatch(name)
    if match is None:
        return None
    year, category = int(match[1]), match[2]
    fetch = partial(ensure_amazon, category=category, year=year)
    return DatasetSpec(amazon_remote(category, year).filename, "amazon", fetch)


def _only_file(folder: Path) -> Path:
    """The single interaction file in ``folder`` (helper files are ignored)."""
    files = [p for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")]
    candidates = [p for p in files if not _NOT_INTERACTIONS.search(p.name)]
    if len(candidates) != 1:
        names = [p.name for p in candidates]
        raise ValueError(f"{folder}: expected one interaction file, found {names}; pass path=")
    return candidates[0]


def resolve_dataset(name: str, data_root: str | Path, download: bool = False) -> tuple[Path, str]:
    """``(file, format)`` of dataset ``name`` under ``data_root``.

    With ``download=True`` a missing downloadable file is fetched into
    ``<data_root>/<name>/``. A missing file otherwise raises
    ``FileNotFoundError`` saying where to put it.
    """
    folder = Path(data_root) / name
    spec = _spec(name)
    if spec is None:
        if not folder.is_dir():
            known = sorted(KNOWN_DATASETS)
            raise FileNotFoundError(f"unknown dataset {name!r}: no folder {folder}; known: {known}")
        path = _only_file(folder)
        return path, sniff_format(path)
    path = folder / spec.filename
    if not path.is_file() and download and spec.fetch is not None:
        path = spec.fetch(folder)
    if not path.is_file():
        hint = "; or set download=True" if spec.fetch is not None else ""
        raise FileNotFoundError(
            f"dataset {name!r}: file not found at {path.absolute()}; point data_root "
            f"(--data.init_args.data_root) at the folder that holds {folder.name}/{hint}"
        )
    return path, spec.format
