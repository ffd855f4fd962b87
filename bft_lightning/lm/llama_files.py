"""The file names of a Llama-format checkpoint folder, its config and the errors that
name a folder's contents (``models.checkpoint`` reads and writes the weights)."""

from __future__ import annotations

import json
import re
from pathlib import Path

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILE = "tokenizer.json"
BFT_OPTIONS_FILE = "bft_options.json"
BFT_WEIGHTS_FILE = "bft.safetensors"
_OURS = (SAFETENSORS_FILE, SAFETENSORS_INDEX, BFT_OPTIONS_FILE, BFT_WEIGHTS_FILE)
_TMP_PREFIX = ".bft-tmp-"  # a write's files before they take their names
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class CheckpointError(FileNotFoundError):
    """A checkpoint directory is missing or incomplete."""


def _listing(directory: Path) -> str:
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    return ", ".join(names[:20]) + (" ..." if len(names) > 20 else "") or "(empty)"


def _require_dir(directory: str | Path) -> Path:
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} does not exist. Point it at a local copy of a "
            "Llama-format model (config.json + *.safetensors + tokenizer.json); nothing is "
            "downloaded at run time."
        )
    return path


def read_config(directory: str | Path) -> dict:
    """The parsed ``config.json`` of a checkpoint directory."""
    path = _require_dir(directory)
    file = path / CONFIG_FILE
    if not file.is_file():
        interrupted = any(path.glob(f"{_TMP_PREFIX}*")) or any(path.glob("*.safetensors"))
        raise CheckpointError(
            f"{str(path)!r} has no {CONFIG_FILE}; found: {_listing(path)}. A Llama-format "
            "checkpoint needs config.json, model*.safetensors and tokenizer.json."
            + (" If an export into it was interrupted, write it again." if interrupted else "")
        )
    config = _read_json(file)
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def _read_json(file: Path) -> object:
    try:
        with file.open(encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
