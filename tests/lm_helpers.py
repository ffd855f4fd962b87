"""Helpers of the language-model tests: a tiny random Llama checkpoint on disk.

The checkpoint is written by ``transformers`` (a test-only dependency) in the
format TinyLlama ships (``config.json``, sharded ``*.safetensors``), next to a
``tokenizer.json`` built with ``tokenizers``; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.3,  # large enough that logits are not all ties
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_tokenizer_json(path: Path) -> Path:
    """A 64-id word-level tokenizer: specials 0-3, then 60 lower-case words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>"])
    file = path / "tokenizer.json"
    tok.save(str(file))
    return file


def write_hf_checkpoint(path: Path, seed: int = 0, **overrides: object) -> Path:
    """Write a random ``transformers`` Llama (sharded safetensors) and a tokenizer to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, max_shard_size="20KB")
    tiny_tokenizer_json(path)
    return path


def write_squad_file(path: Path, articles: int = 6, paragraphs: int = 4, seed: int = 0) -> Path:
    """A synthetic SQuAD v1.1 file over the tiny tokenizer's words ``w4 .. w59``.

    Each question asks for the word after a cue word in its paragraph (a copy
    task a tiny model can learn); ``answer_start`` is the answer's offset.
    """
    import json
    import random

    rng = random.Random(seed)
    data = []
    for a in range(articles):
        paras = []
        for p in range(paragraphs):
            words = [f"w{rng.randrange(4, 60)}" for _ in range(rng.randrange(12, 30))]
            ctx = " ".join(words)
            qas = []
            for q in range(3):
                i = rng.randrange(0, len(words) - 1)
                start = len(" ".join(words[: i + 1])) + 1
                answer = words[i + 1]
                assert ctx[start : start + len(answer)] == answer
                qas.append(
                    {
                        "id": f"a{a}p{p}q{q}",
                        "question": f"w{rng.randrange(4, 60)} {words[i]}",
                        "answers": [{"text": answer, "answer_start": start}],
                    }
                )
            paras.append({"context": ctx, "qas": qas})
        data.append({"title": f"Article_{a}", "paragraphs": paras})
    path.write_text(json.dumps({"version": "1.1", "data": data}))
    return path
