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
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILE = "tokenizer.json"
BFT_OPTIONS_FILE = "bft_options.json"
BFT_WEIGHTS_FILE = "bft.safetensors"
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
        raise CheckpointError(
            f"{str(path)!r} has no {CONFIG_FILE}; found: {_listing(path)}. A Llama-format "
            "checkpoint needs config.json, model*.safetensors and tokenizer.json."
        )
    with file.open(encoding="utf-8") as f:
        return json.load(f)


def weight_files(directory: str | Path) -> list[Path]:
    """The weight files of a checkpoint, shards in index order; raises if any is missing."""
    path = _require_dir(directory)
    for index_name, single in ((SAFETENSORS_INDEX, SAFETENSORS_FILE), (TORCH_INDEX, TORCH_FILE)):
        index = path / index_name
        if index.is_file():
            with index.open(encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
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
    out: dict[str, Tensor] = {}
    for file in weight_files(directory):
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            part = load_file(str(file))
        else:
            part = torch.load(file, map_location="cpu", weights_only=True)
        for name, tensor in part.items():
            out[name] = (
                tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            )
    return out


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
    given, go to ``bft_options.json`` and ``bft.safetensors``. Returns the weight
    files written.

    Every file is first written under a temporary name and renamed into place
    once all are complete (``config.json`` last), so an interrupted write leaves
    no half-written file under a real name. Files of an earlier write into the
    same directory that this one does not replace (other shards or index, BFT
    files) are removed, so that they cannot be read as part of this checkpoint.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
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
        final = path / name
        tmp = path / f".{name}.tmp-{os.getpid()}"
        write(tmp)
        staged.append((tmp, final))
        return final

    def stage_json(name: str, obj: object) -> None:
        def write(tmp: Path) -> None:
            with tmp.open("w", encoding="utf-8") as f:
                json.dump(obj, f, indent=2, sort_keys=True)

        stage(name, write)

    try:
        files: list[Path] = []
        if len(shards) == 1:
            files.append(stage(SAFETENSORS_FILE, functools.partial(_save, shards[0], meta)))
        else:
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                files.append(stage(name, functools.partial(_save, shard, meta)))
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            stage_json(SAFETENSORS_INDEX, index)
        if bft_state:
            bft = {k: v.detach().contiguous().cpu() for k, v in bft_state.items()}
            stage(BFT_WEIGHTS_FILE, functools.partial(_save, bft, meta))
        if bft_options is not None:
            stage_json(BFT_OPTIONS_FILE, bft_options)
        stage_json(CONFIG_FILE, config)
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        for tmp in path.glob(f".*.tmp-{os.getpid()}"):
            tmp.unlink(missing_ok=True)
        raise
    written = {final.name for _, final in staged}
    # an earlier write's files that this one does not replace: removed before the new
    # files take their names, so an interruption here leaves an incomplete directory
    # (a clear error on reading) rather than a stale index that a reader would follow
    for old in path.iterdir():
        ours = old.name in (SAFETENSORS_FILE, SAFETENSORS_INDEX, BFT_OPTIONS_FILE, BFT_WEIGHTS_FILE)
        if (ours or _SHARD.fullmatch(old.name)) and old.name not in written:
            old.unlink()
    for tmp, final in staged:  # config.json last
        os.replace(tmp, final)
    return files


def _save(tensors: dict[str, Tensor], metadata: dict[str, str], file: Path) -> None:
    import safetensors.torch  # looked up at call time (a test replaces save_file)

    safetensors.torch.save_file(tensors, str(file), metadata=metadata)


def read_bft_state(directory: str | Path) -> tuple[dict | None, dict[str, Tensor]]:
    """The BFT options and tensors a BFT model wrote next to its Llama files
    (:func:`write_checkpoint`): ``(None, {})`` for a plain Llama checkpoint."""
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
    if (path / BFT_WEIGHTS_FILE).is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(path / BFT_WEIGHTS_FILE))
    return options, tensors


@dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the special ids an LM needs.

    ``encode`` never adds special tokens itself: the caller says whether a BOS
    goes first, so prompts and answers can be encoded apart and joined. Segments
    are encoded as continuations of the text before them: a sentencepiece-style
    tokenizer (Llama 2, TinyLlama) marks the start of every input with ``▁``
    (a ``Prepend`` normalizer, or ``Metaspace`` with ``prepend_scheme="first"``),
    which separately encoded segments would each carry: ``" Paris"`` became
    ``▁ ▁Paris`` instead of the ``▁Paris`` the model reads in running text.
    ``segment_tokenizer`` is the same tokenizer without that start marker;
    ``save`` writes the original.
    """

    tokenizer: object
    bos_id: int | None
    eos_id: int
    pad_id: int
    segment_tokenizer: object | None = None

    @property
    def _segments(self) -> object:
        return self.tokenizer if self.segment_tokenizer is None else self.segment_tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))  # type: ignore[attr-defined]

    def _for(self, start: bool) -> object:
        return self.tokenizer if start else self._segments

    def encode(self, text: str, bos: bool = False, start: bool | None = None) -> list[int]:
        """Ids of ``text``: a continuation of the text before it, or with ``start``
        (default: ``bos``) the start of a document, with the tokenizer's own marker."""
        start = bos if start is None else start
        ids = self._for(start).encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]
        return ([self.bos_id] if bos and self.bos_id is not None else []) + list(ids)

    def encode_with_offsets(
        self, text: str, start: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and (start, end) character offsets of each token in ``text``."""
        enc = self._for(start).encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))  # type: ignore[attr-defined]

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))  # type: ignore[attr-defined]


def segment_tokenizer(tok: object) -> object | None:
    """``tok`` without its start-of-input ``▁`` marker (see :class:`TextTokenizer`),
    or None when it has none (byte-level and our own BPE tokenizers)."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())  # type: ignore[attr-defined]
    changed = False

    def strip(node: dict | None, kind: str) -> dict | None:
        nonlocal changed
        if node is None:
            return None
        if node.get("type") == "Sequence":
            key = "normalizers" if kind == "normalizer" else "pretokenizers"
            parts = [strip(n, kind) for n in node.get(key, [])]
            node[key] = [n for n in parts if n is not None]
            return node
        if kind == "normalizer" and node.get("type") == "Prepend":
            changed = True
            return None
        if kind == "pre_tokenizer" and node.get("type") == "Metaspace":
            if node.get("prepend_scheme", "always") != "never" or node.get("add_prefix_space"):
                changed = True
                node["prepend_scheme"] = "never"
                node.pop("add_prefix_space", None)
        return node

    spec["normalizer"] = strip(spec.get("normalizer"), "normalizer")
    spec["pre_tokenizer"] = strip(spec.get("pre_tokenizer"), "pre_tokenizer")
    return Tokenizer.from_str(json.dumps(spec)) if changed else None


def _token_id(tok: object, names: Iterable[str]) -> int | None:
    for name in names:
        i = tok.token_to_id(name)  # type: ignore[attr-defined]
        if i is not None:
            return int(i)
    return None


def load_tokenizer(path: str | Path, config: dict | None = None) -> TextTokenizer:
    """Load ``tokenizer.json`` (a file, or a checkpoint directory holding one).

    Special ids come from ``config`` (``bos_token_id``, ``eos_token_id``,
    ``pad_token_id``) when given, else from the usual token strings
    (``<s>``, ``</s>``, ``<pad>``, ``<|endoftext|>``). Without a pad token the
    pad id is the EOS id (padding is masked anyway).
    """
    from tokenizers import Tokenizer

    file = Path(path).expanduser()
    if file.is_dir():
        if config is None and (file / CONFIG_FILE).is_file():
            config = read_config(file)
        directory, file = file, file / TOKENIZER_FILE
        if not file.is_file():
            raise CheckpointError(
                f"{str(directory)!r} has no {TOKENIZER_FILE}; found: {_listing(directory)}. "
                "Only the fast-tokenizer file is read (a sentencepiece tokenizer.model can be "
                "converted once, offline, with transformers' AutoTokenizer(...).save_pretrained)."
            )
    elif not file.is_file():
        raise CheckpointError(f"tokenizer file {str(file)!r} does not exist")
    tok = Tokenizer.from_file(str(file))
    config = config or {}
    bos = config.get("bos_token_id")
    eos = config.get("eos_token_id")
    pad = config.get("pad_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    bos = bos if bos is not None else _token_id(tok, ("<s>", "<|begin_of_text|>", "<bos>"))
    eos = eos if eos is not None else _token_id(tok, ("</s>", "<|endoftext|>", "<eos>"))
    if eos is None:
        raise ValueError(f"{str(file)!r}: no EOS token found; set eos_token_id in config.json")
    pad = pad if pad is not None else _token_id(tok, ("<pad>", "[PAD]"))
    pad = int(pad if pad is not None else eos)
    return TextTokenizer(tok, bos, int(eos), pad, segment_tokenizer(tok))
