"""The output-path guard every writer calls before any work.

One rule set for ``recommend --output``, ``predict``'s writer, ``calibrate
--output`` and every later writer (``export``, ``tune``):

- a command never writes over one of its own inputs (the data, the
  checkpoint, the config): the paths are compared as resolved real paths and
  as file identities (device and inode), so a symbolic or hard link to an
  input is caught too;
- an existing file that is not an input is replaced only when the user said
  so (``--overwrite``), and the caller says that it replaced it;
- a directory, a missing parent folder or one that cannot be written is
  refused.

Each refusal is an :class:`OutputPathError` (a ``ValueError``) with one line
naming the option and the path, so the command line prints it as ``error:
...`` with exit status 2. Writers stay atomic (temporary file + rename in the
target's folder): this guard decides whether to write, not how.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["OutputPathError", "check_output", "same_file"]


class OutputPathError(ValueError):
    """An output path that would destroy a file or cannot be written."""


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` are one file: the same real path, or the same inode
    (a hard link). Paths that do not exist compare by real path only."""
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output(
    path: str | os.PathLike,
    inputs: Iterable[str | os.PathLike | None] = (),
    overwrite: bool = False,
    what: str = "--output",
) -> bool:
    """Refuse an output path that is unsafe; returns whether an existing file will be replaced.

    Args:
        path: where the command will write.
        inputs: the files the command reads (data, checkpoint, config; None entries
            and remote URLs are skipped). The output may never be one of them, even
            with ``overwrite``.
        overwrite: the user allowed replacing an existing file that is not an input.
        what: the option that names ``path``, for the message (``--output``).

    Raises:
        OutputPathError: one line naming ``what`` and ``path``.
    """
    text = os.fspath(path)
    if not text.strip():
        raise OutputPathError(f"{what}: empty path")
    target = Path(os.path.expanduser(text))
    for source in inputs:
        if source is None or "://" in os.fspath(source):
            continue
        if same_file(target, source):
            raise OutputPathError(
                f"{what} {text}: is one of the command's inputs ({source}); it is never "
                "overwritten: write the output to another file"
            )
    if target.is_dir():
        raise OutputPathError(f"{what} {text}: is a directory; give a file name")
    parent = _real(target).parent
    if not parent.exists():
        raise OutputPathError(f"{what} {text}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputPathError(f"{what} {text}: {parent} is not a folder")
    if not _writable(parent):
        raise OutputPathError(f"{what} {text}: the folder {parent} is read-only")
    exists = target.exists() or target.is_symlink()
    if exists and not overwrite:
        raise OutputPathError(
            f"{what} {text}: the file exists; pass --overwrite to replace it, or choose "
            "another file"
        )
    if exists and not target.is_symlink() and not _writable(target):
        raise OutputPathError(f"{what} {text}: the file exists and is read-only")
    return exists


def _writable(path: Path) -> bool:
    """Writable by this process, and not marked read-only for everyone (which even
    root, who may write anyway, takes as the owner's wish)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return os.access(path, os.W_OK) and bool(mode & 0o222)
