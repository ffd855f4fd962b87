"""The tokenizer of a Llama-format checkpoint (``tokenizer.json``) with the special ids
an LM needs; local files only."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bft_lightning.lm.llama_files import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    _listing,
    read_config,
)


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
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception, unlocated
        raise ValueError(f"{file}: not a readable tokenizer.json ({e})") from e
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
    size = tok.get_vocab_size()
    for name, value in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)):
        if value is not None and (not isinstance(value, int) or not 0 <= value < size):
            raise ValueError(
                f"{file}: {name}={value!r} (config.json) is not one of the tokenizer's {size} ids"
            )
    return TextTokenizer(tok, bos, int(eos), pad, segment_tokenizer(tok))
