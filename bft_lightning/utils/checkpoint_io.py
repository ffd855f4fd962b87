"""Checkpoints that are written atomically and loaded without unpickling code.

Writing: ``torch.save`` goes to a ``.tmp-*`` file in the checkpoint's own
folder, which is flushed, fsync'ed and then renamed over the target with
``os.replace`` (atomic on POSIX within one file system); the folder is fsync'ed
after the rename. A process killed at any point leaves either the previous
complete file or the new complete file, never a truncated one, and at most a
``.tmp-*`` file that nothing reads. (Lightning's own writer stages the file in
the system temporary folder and moves it, which is a copy, so not atomic, when
the log folder is another file system, e.g. a Docker volume.)

Loading: ``torch.load(..., weights_only=True)`` always, so a checkpoint can
hold tensors and plain containers but no code; a truncated, corrupt or unsafe
file raises :class:`CheckpointLoadError` naming the file and what is wrong.

Digest: :class:`AtomicCheckpointIO` stores a SHA-256 of the checkpoint's
content (every tensor's dtype, shape and bytes, every other value's repr, in
key order) as one more record of the file's zip archive (``<archive>/bft_lightning.sha256``),
written in the same atomic write; ``torch.load`` ignores it.
:func:`safe_load_checkpoint` recomputes it and refuses a file whose content
changed after it was written (a flipped bit in a weight loads without any error
from ``torch.load``).

The check fails closed. The writer also marks the checkpoint's format record
as ``sealed`` (:mod:`bft_lightning.utils.checkpoint_format`): a sealed
checkpoint whose digest record is missing, unreadable or damaged (e.g. a
changed byte that breaks the record's zip CRC) is refused, naming the file, and
so is any file whose digest record exists but cannot be read. Only a
checkpoint that was never sealed (from before digests existed, or written by
Lightning's own writer) loads without one, with a warning that its content
cannot be verified.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

__all__ = [
    "DIGEST_RECORD",
    "AtomicCheckpointIO",
    "CheckpointLoadError",
    "atomic_torch_save",
    "content_digest",
    "digest_record",
    "safe_load_checkpoint",
    "stored_digest",
]

DIGEST_RECORD = "bft_lightning.sha256"


class CheckpointLoadError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, unsafe or of the wrong kind."""


def _is_remote(path: str | os.PathLike) -> bool:
    return "://" in str(path)


def atomic_torch_save(obj: Any, path: str | os.PathLike, digest: str | None = None) -> None:
    """``torch.save(obj, path)`` through a temporary file in the same folder + ``os.replace``.

    ``digest`` (see :func:`content_digest`) is added to the archive as a record of its own.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{target.name}-", dir=target.parent)
    try:
        with os.fdopen(fd, "w+b") as fh:
            torch.save(obj, fh)
            if digest is not None:
                fh.seek(0)
                with zipfile.ZipFile(fh, "a") as archive:
                    prefix = archive.namelist()[0].split("/")[0]
                    archive.writestr(f"{prefix}/{DIGEST_RECORD}", digest)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _feed(h: Any, obj: Any) -> None:
    """Hash ``obj`` canonically: containers in key order, tensors by dtype, shape and bytes."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        items = sorted(obj.items(), key=lambda kv: repr(kv[0]))
        h.update(f"D{len(items)}:".encode())
        for key, value in items:
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, list | tuple):
        h.update(f"{type(obj).__name__[0]}{len(obj)}:".encode())
        for value in obj:
            _feed(h, value)
    elif isinstance(obj, set | frozenset):
        h.update(f"S{len(obj)}:".encode())
        for value in sorted(obj, key=repr):
            _feed(h, value)
    else:
        text = repr(obj).encode()
        h.update(f"V{type(obj).__name__}{len(text)}:".encode() + text)


def content_digest(checkpoint: Any) -> str:
    """SHA-256 (hex) of a checkpoint's content: independent of how the file is laid out."""
    h = hashlib.sha256()
    _feed(h, checkpoint)
    return h.hexdigest()


def stored_digest(path: str | os.PathLike) -> str | None:
    """The digest record of a checkpoint file, or None (none written, unreadable, not a zip)."""
    state, value = digest_record(path)
    return value if state == "ok" else None


def digest_record(path: str | os.PathLike) -> tuple[str, str | None]:
    """``("ok", digest)``, ``("missing", None)`` or ``("damaged", what is wrong)``."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/" + DIGEST_RECORD)), None)
            if name is None:
                return "missing", None
            try:
                raw = archive.read(name)
            except (zipfile.BadZipFile, OSError, KeyError, ValueError, EOFError) as err:
                return "damaged", f"{type(err).__name__}: {err}"
    except (zipfile.BadZipFile, OSError, KeyError, ValueError, EOFError) as err:
        return "damaged", f"not a readable zip archive: {err}"
    text = raw.decode("ascii", "replace")
    if len(text) != 64 or any(ch not in "0123456789abcdef" for ch in text):
        return "damaged", "not a SHA-256 hex digest"
    return "ok", text


def _check_digest(file: Path, obj: dict[str, Any]) -> None:
    from bft_lightning.utils.checkpoint_format import CHECKPOINT_KEY, is_sealed

    state, value = digest_record(file)
    if state == "damaged" and (is_sealed(obj) or "not a readable zip" not in str(value)):
        raise CheckpointLoadError(
            f"{file}: its content digest record is damaged ({value}): the file cannot be "
            "verified and is not loaded. Use another checkpoint."
        )
    if state != "ok":
        if is_sealed(obj):
            raise CheckpointLoadError(
                f"{file}: written with a content digest, but the digest record is missing: "
                "the file cannot be verified and is not loaded. Use another checkpoint."
            )
        if isinstance(obj.get(CHECKPOINT_KEY), dict):
            warnings.warn(
                f"{file}: the checkpoint carries no content digest (written before checkpoints "
                "carried one, or without AtomicCheckpointIO): its content cannot be verified",
                UserWarning,
                stacklevel=3,
            )
        return
    if value != content_digest(obj):
        raise CheckpointLoadError(
            f"{file}: content digest mismatch: the file changed after it was written "
            "(disk or copy corruption); it is not loaded. Use another checkpoint."
        )


def safe_load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; every failure names the file."""
    file = Path(path)
    if file.is_dir():
        raise CheckpointLoadError(f"{file}: is a directory, not a checkpoint file")
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint not found: {file}")
    if file.stat().st_size == 0:
        raise CheckpointLoadError(f"{file}: empty file (an interrupted write?), not a checkpoint")
    try:
        obj = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as err:  # whatever fails, the file is not a usable checkpoint
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        lines = lines or [type(err).__name__]
        if isinstance(err, pickle.UnpicklingError) and lines[0].startswith("Weights only"):
            # the unpickler met something other than tensors and plain containers
            what = [line for line in lines if "global" in line.lower() or "unpickler" in line]
            raise CheckpointLoadError(
                f"{file}: refused to load: it holds objects that are not tensors or plain "
                f"containers ({(what or lines)[0]}). Only weights_only=True loading is "
                "allowed; re-save the checkpoint from a trusted environment if it is yours."
            ) from None
        raise CheckpointLoadError(
            f"{file}: not a complete PyTorch checkpoint (truncated or corrupt: "
            f"{type(err).__name__}: {lines[0]})"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointLoadError(f"{file}: expected a checkpoint dict, found {type(obj).__name__}")
    _check_digest(file, obj)
    return obj


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO``: atomic writes with a digest; checked ``weights_only`` loads.

    Use it with ``Trainer(plugins=[AtomicCheckpointIO()])`` or, in a trainer
    config, ``plugins: [{class_path: bft_lightning.utils.AtomicCheckpointIO}]``.
    Remote paths (``s3://`` ...) fall back to Lightning's own writer and reader.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if _is_remote(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        from bft_lightning.utils.checkpoint_format import seal

        seal(checkpoint)
        atomic_torch_save(checkpoint, path, digest=content_digest(checkpoint))

    def load_checkpoint(
        self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only: Any = None
    ) -> dict[str, Any]:
        if _is_remote(path):
            return super().load_checkpoint(path, map_location, weights_only=True)
        return safe_load_checkpoint(path, map_location)
