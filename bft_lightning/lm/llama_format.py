"""Llama-format checkpoints on local disk: ``config.json``, ``*.safetensors``, ``tokenizer.json``.

The layout is the one Hugging Face ships (TinyLlama, Llama 2, ...):

- ``config.json``: the architecture (``hidden_size``, ``num_attention_heads``, ...);
- ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` listed in
  ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``); a legacy
  ``pytorch_model.bin`` (or its sharded index) is read with ``weights_only=True``;
- ``tokenizer.json``: a ``tokenizers`` tokenizer (the fast-tokenizer file).

A BFT model writes its filter state next to these (files that Llama readers,
``transformers`` included, do not read): ``bft_options.json`` (the options it
was built with) and ``bft.safetensors`` (prior, process noise, sill, gate).

Nothing here touches the network: a missing file is an error that names the
directory's contents and what was expected.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from bft_lightning.lm.llama_files import (
    _OURS,
    _SHARD,
    _TMP_PREFIX,
    BFT_OPTIONS_FILE,
    BFT_WEIGHTS_FILE,
    CONFIG_FILE,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    TOKENIZER_FILE,
    TORCH_FILE,
    TORCH_INDEX,
    CheckpointError,
    _listing,
    _read_json,
    _require_dir,
    read_config,
)
from bft_lightning.lm.tokenizer import TextTokenizer, load_tokenizer, segment_tokenizer

__all__ = [
    "BFT_OPTIONS_FILE",
    "BFT_WEIGHTS_FILE",
    "CONFIG_FILE",
    "SAFETENSORS_FILE",
    "SAFETENSORS_INDEX",
    "TOKENIZER_FILE",
    "TORCH_FILE",
    "TORCH_INDEX",
    "CheckpointError",
    "TensorInfo",
    "TextTokenizer",
    "check_finite",
    "llama_fingerprint",
    "load_tokenizer",
    "read_bft_state",
    "read_config",
    "read_state_dict",
    "read_weights",
    "segment_tokenizer",
    "tensor_headers",
    "weight_files",
    "write_checkpoint",
]


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a shard index, checked: tensor names to file names."""
    data = _read_json(index)
    weight_map = data.get("weight_map", {}) if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{index}: weight_map must be a JSON object of tensor name -> file name")
    bad = [v for v in weight_map.values() if Path(v).name != v]
    if bad:
        raise ValueError(f"{index}: weight_map names files outside the folder: {bad[:4]}")
    return weight_map


def weight_files(directory: str | Path) -> list[Path]:
    """The weight files of a checkpoint, shards in index order; raises if any is missing."""
    path = _require_dir(directory)
    for index_name, single in ((SAFETENSORS_INDEX, SAFETENSORS_FILE), (TORCH_INDEX, TORCH_FILE)):
        index = path / index_name
        if index.is_file():
            weight_map = _weight_map(index)
            names = list(dict.fromkeys(weight_map.values()))
            missing = [n for n in names if not (path / n).is_file()]
            if missing or not names:
                raise CheckpointError(
                    f"{str(path)!r}: {index_name} lists shards that are missing: "
                    f"{missing or '(no weight_map)'}; found: {_listing(path)}"
                )
            return [path / n for n in names]
        if (path / single).is_file():
            return [path / single]
    loose = sorted(p for p in path.glob("*.safetensors") if p.name != BFT_WEIGHTS_FILE)
    if loose:
        return loose
    raise CheckpointError(
        f"{str(path)!r} has no weights ({SAFETENSORS_FILE}, {SAFETENSORS_INDEX} with its "
        f"shards, or {TORCH_FILE}); found: {_listing(path)}"
    )


def read_state_dict(directory: str | Path, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """All tensors of a checkpoint's weight files, optionally cast to ``dtype``."""
    return read_weights(directory, dtype)[0]


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's shape, dtype (``torch.dtype`` or a safetensors code) and file."""

    shape: tuple[int, ...]
    dtype: str
    file: Path

    @property
    def is_float(self) -> bool:
        return self.dtype in _FLOAT_DTYPES


_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"} | {
    str(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def _index_of(path: Path) -> Path | None:
    for name in (SAFETENSORS_INDEX, TORCH_INDEX):
        if (path / name).is_file():
            return path / name
    return None


def tensor_headers(directory: str | Path) -> dict[str, TensorInfo] | None:
    """Every stored tensor's shape and dtype, read from the safetensors headers only
    (nothing is loaded or allocated); None for ``pytorch_model.bin`` weights, whose
    shapes are known only once loaded.

    Raises, naming the file, on a header that does not parse or a file shorter
    than its header says (a truncated shard), and, naming the index, on a tensor
    the index places in a shard that does not hold it.
    """
    path = _require_dir(directory)
    files = weight_files(path)
    if any(f.suffix != ".safetensors" for f in files):
        return None
    from safetensors import safe_open

    out: dict[str, TensorInfo] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    out[name] = TensorInfo(tuple(part.get_shape()), part.get_dtype(), file)
        except Exception as e:  # safetensors raises its own error types, unlocated
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
    index = _index_of(path)
    if index is not None:
        for name, shard in _weight_map(index).items():
            if name not in out or out[name].file.name != shard:
                where = f"it is in {out[name].file.name}" if name in out else "no shard holds it"
                raise ValueError(f"{index}: places tensor {name} in {shard}, but {where}")
    return out


def read_weights(
    directory: str | Path, dtype: torch.dtype | None = None
) -> tuple[dict[str, Tensor], dict[str, Path]]:
    """All tensors of a checkpoint's weight files (floating ones cast to ``dtype``)
    and the file each came from. A file that does not load is an error naming it."""
    out: dict[str, Tensor] = {}
    source: dict[str, Path] = {}
    for file in weight_files(directory):
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                part = load_file(str(file))
            else:
                part = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated, malformed or unsafe: name the file
            raise ValueError(f"{file}: the weights do not load ({e})") from e
        if not isinstance(part, dict) or not all(isinstance(t, Tensor) for t in part.values()):
            raise ValueError(f"{file}: expected a mapping of tensor names to tensors")
        for name, tensor in part.items():
            out[name] = (
                tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            )
            source[name] = file
    return out, source


def check_finite(tensors: dict[str, Tensor], source: dict[str, Path] | Path) -> None:
    """Raise, naming the tensor and its file, where a floating tensor holds NaN or inf."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            file = source if isinstance(source, Path) else source.get(name, "?")
            n = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{file}: tensor {name} holds {n} NaN or inf values")


def write_checkpoint(
    directory: str | Path,
    config: dict,
    state_dict: dict[str, Tensor],
    max_shard_bytes: int | None = None,
    bft_options: dict | None = None,
    bft_state: dict[str, Tensor] | None = None,
) -> list[Path]:
    """Write ``config.json`` and safetensors weights, sharded above ``max_shard_bytes``.

    Sharded output follows the Hugging Face layout (``model-0000i-of-0000N.safetensors``
    plus ``model.safetensors.index.json``). ``bft_options`` and ``bft_state``, when
    given, go to ``bft_options.json`` and ``bft.safetensors``; the latter records
    a fingerprint of the Llama files beside it (:func:`llama_fingerprint`), so that
    a reader can tell when another writer has replaced them since. Returns the
    weight files written.

    Nothing is lost to an interruption: every file is first written in full
    under a temporary name (``.bft-tmp-*``). Only then is the directory changed:
    ``config.json`` is removed first, then the earlier write's files that this
    one does not replace (other shards or index, BFT files), then the new files
    take their names, ``config.json`` last. A directory caught between these
    steps has no ``config.json``, which every reader refuses with a clear error
    (it never loads a mix of two writes). Temporaries are removed on failure,
    and those of a killed earlier write when the next one starts.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for orphan in path.glob(f"{_TMP_PREFIX}*"):  # a killed earlier write's
        orphan.unlink(missing_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    meta = {"format": "pt"}
    staged: list[tuple[Path, Path]] = []  # (temporary, final)

    def stage(name: str, write: Callable[[Path], object]) -> Path:
        tmp = path / f"{_TMP_PREFIX}{os.getpid()}-{name}"
        staged.append((tmp, path / name))
        write(tmp)
        return tmp

    def stage_text(name: str, text: str) -> Path:
        return stage(name, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    try:
        files: list[Path] = []
        weights: list[Path] = []  # the staged weight files, for the fingerprint
        if len(shards) == 1:
            weights.append(stage(SAFETENSORS_FILE, functools.partial(_save, shards[0], meta)))
            files.append(path / SAFETENSORS_FILE)
        else:
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                weights.append(stage(name, functools.partial(_save, shard, meta)))
                files.append(path / name)
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            stage_text(SAFETENSORS_INDEX, json.dumps(index, indent=2))
        config_text = json.dumps(config, indent=2, sort_keys=True)
        if bft_state:
            sizes = [(f.name, t.stat().st_size) for f, t in zip(files, weights, strict=True)]
            bft_meta = {**meta, "llama_fingerprint": _fingerprint(config_text, sizes)}
            bft = {k: v.detach().contiguous().cpu() for k, v in bft_state.items()}
            stage(BFT_WEIGHTS_FILE, functools.partial(_save, bft, bft_meta))
        if bft_options is not None:
            stage_text(BFT_OPTIONS_FILE, json.dumps(bft_options, indent=2, sort_keys=True))
        stage_text(CONFIG_FILE, config_text)
        # the commit: from here until config.json is renamed, the directory has none
        (path / CONFIG_FILE).unlink(missing_ok=True)
        written = {final.name for _, final in staged}
        for old in path.iterdir():
            if (old.name in _OURS or _SHARD.fullmatch(old.name)) and old.name not in written:
                old.unlink()
        for tmp, final in staged:  # config.json last
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    return files


def _fingerprint(config_text: str, weight_sizes: Sequence[tuple[str, int]]) -> str:
    digest = hashlib.sha256(config_text.encode("utf-8"))
    for name, size in weight_sizes:
        digest.update(f"\n{name}:{size}".encode())
    return digest.hexdigest()


def llama_fingerprint(directory: str | Path) -> str:
    """A hash of ``config.json``'s bytes and the weight files' names and sizes: it
    changes when another writer (``transformers``' ``save_pretrained``, a copy of
    other weights) replaces the Llama files of a BFT export."""
    path = _require_dir(directory)
    config_text = (path / CONFIG_FILE).read_text(encoding="utf-8")
    return _fingerprint(config_text, [(f.name, f.stat().st_size) for f in weight_files(path)])


def _save(tensors: dict[str, Tensor], metadata: dict[str, str], file: Path) -> None:
    import safetensors.torch  # looked up at call time (a test replaces save_file)

    safetensors.torch.save_file(tensors, str(file), metadata=metadata)


def read_bft_state(directory: str | Path) -> tuple[dict | None, dict[str, Tensor]]:
    """The BFT options and tensors a BFT model wrote next to its Llama files
    (:func:`write_checkpoint`): ``(None, {})`` for a plain Llama checkpoint.

    When the Llama files are no longer those the BFT tensors were written with
    (:func:`llama_fingerprint`: another writer replaced them), both files are
    ignored with a warning: that state belongs to other weights.
    """
    path = _require_dir(directory)
    options = None
    if (path / BFT_OPTIONS_FILE).is_file():
        try:
            with (path / BFT_OPTIONS_FILE).open(encoding="utf-8") as f:
                options = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path / BFT_OPTIONS_FILE}: not valid JSON ({e})") from e
        if not isinstance(options, dict):
            raise ValueError(f"{path / BFT_OPTIONS_FILE}: expected a JSON object")
    tensors: dict[str, Tensor] = {}
    file = path / BFT_WEIGHTS_FILE
    if file.is_file():
        from safetensors import safe_open
        from safetensors.torch import load_file

        try:
            with safe_open(str(file), framework="pt") as f:
                recorded = (f.metadata() or {}).get("llama_fingerprint")
        except Exception as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
        if recorded != llama_fingerprint(path):
            warnings.warn(
                f"{file} and {path / BFT_OPTIONS_FILE} were written with other Llama files "
                "than those now beside them (config.json or the weight files changed since): "
                "ignored, the BFT state starts as for a plain Llama checkpoint",
                stacklevel=3,
            )
            return None, {}
        try:
            tensors = load_file(str(file))
        except Exception as e:
            raise ValueError(f"{file}: the BFT tensors do not load ({e})") from e
        for name, tensor in tensors.items():
            if not tensor.is_floating_point():
                raise ValueError(
                    f"{file}: tensor {name} has dtype {tensor.dtype}; BFT tensors must be "
                    "floating point"
                )
        check_finite(tensors, file)
    return options, tensors
