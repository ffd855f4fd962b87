"""Our Llama against ``transformers.LlamaForCausalLM`` from the same files (precision off)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from lm_helpers import TINY, write_hf_checkpoint

from bft_lightning.lm.llama_format import CheckpointError, load_tokenizer, weight_files
from bft_lightning.lm.model import BFTOptions, LlamaConfig, LlamaForCausalLM
from bft_lightning.nn.filter import FilterConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread

pytest.importorskip("transformers")


def _ids(b: int = 3, t: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, TINY["vocab_size"], (b, t), generator=g)


def test_checkpoint_is_sharded_and_config_parsed(hf_checkpoint: Path) -> None:
    assert len(weight_files(hf_checkpoint)) > 1  # the sharded layout is exercised
    model = LlamaForCausalLM.from_pretrained(hf_checkpoint)
    assert model.config.num_key_value_heads == 2 and model.config.head_dim == 8
    assert model.config.rms_norm_eps == pytest.approx(1e-5)


def test_logits_equal_transformers(hf_checkpoint: Path, hf_model) -> None:
    ours = LlamaForCausalLM.from_pretrained(hf_checkpoint).eval()
    ids = _ids()
    with torch.no_grad():
        ref = hf_model(ids).logits
        got = ours(ids).logits
    assert ref.std() > 0.5  # not a degenerate all-ties model
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_left_padding_equals_transformers(hf_checkpoint: Path, hf_model) -> None:
    ours = LlamaForCausalLM.from_pretrained(hf_checkpoint).eval()
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :1] = 0
    with torch.no_grad():
        ref = hf_model(ids, attention_mask=mask).logits
        got = ours(ids, mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-5)


def test_reference_and_sdpa_paths_agree(hf_checkpoint: Path) -> None:
    a = LlamaForCausalLM.from_pretrained(
        hf_checkpoint, BFTOptions(filter=FilterConfig(precision="off", attention_impl="sdpa"))
    )
    b = LlamaForCausalLM.from_pretrained(
        hf_checkpoint, BFTOptions(filter=FilterConfig(precision="off", attention_impl="reference"))
    )
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(a.eval()(ids).logits, b.eval()(ids).logits)


def test_greedy_generation_with_and_without_cache_matches_transformers(
    hf_checkpoint: Path, hf_model
) -> None:
    ours = LlamaForCausalLM.from_pretrained(hf_checkpoint).eval()
    ids = _ids(3, 10)
    cached = ours.generate(ids, max_new_tokens=8, eos_token_id=-1, use_cache=True)
    plain = ours.generate(ids, max_new_tokens=8, eos_token_id=-1, use_cache=False)
    ref = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
        eos_token_id=None, pad_token_id=3,
    )[:, 10:]  # fmt: skip
    assert torch.equal(cached, plain)
    assert torch.equal(cached, ref)


def test_tied_embeddings(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM as HF

    write_hf_checkpoint(tmp_path, seed=3, tie_word_embeddings=True)
    ours = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    hf = HF.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def _bft_model(seed: int = 5, **options) -> LlamaForCausalLM:
    """A BFT model whose BFT tensors are all away from their init (a trained one's)."""
    cfg = LlamaConfig(**{k: v for k, v in TINY.items()})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg, BFTOptions.from_dict({"precision": "on", **options}))
    with torch.no_grad():
        for t in model.bft_state().values():
            t.mul_(1.5).add_(torch.rand_like(t))
    return model


def test_save_pretrained_round_trip(tmp_path: Path) -> None:
    """The Llama files of a BFT export load in transformers as the plain model; ours
    from the same directory gives back the BFT model exactly (options, every tensor,
    logits), with a sill update still pending at save time flushed into it."""
    from transformers import LlamaForCausalLM as HF

    ours = _bft_model(attention_gate="sigmoid", groups=2)
    sill = ours.model.layers[0].sill.clone()
    ours.train()
    ours(_ids(seed=7))  # leaves a pending running-sill update
    ours.eval()
    assert torch.equal(ours.model.layers[0].sill, sill)
    ours.save_pretrained(tmp_path, max_shard_bytes=4096)
    assert not torch.equal(ours.model.layers[0].sill, sill)  # flushed, and saved below
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert (tmp_path / "bft.safetensors").is_file() and (tmp_path / "bft_options.json").is_file()
    back = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert back.bft == ours.bft and back.bft_state_loaded
    want, got = ours.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids).logits, atol=0, rtol=0)
    hf = HF.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with pytest.warns(UserWarning, match="BFT tensors that this model's options do not use"):
        plain = LlamaForCausalLM.from_pretrained(tmp_path, BFTOptions()).eval()
    assert not plain.bft_state_loaded
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_loading_a_bft_export_with_other_shapes_names_the_entry(tmp_path: Path) -> None:
    _bft_model().save_pretrained(tmp_path)  # G = 4 groups
    with pytest.raises(ValueError, match=r"bft\.safetensors: model\.layers\.0\.rho has shape"):
        LlamaForCausalLM.from_pretrained(
            tmp_path, BFTOptions(filter=FilterConfig(precision="on", groups=2))
        )
    (tmp_path / "bft_options.json").write_text('{"precision": "on", "colour": 1}')
    with pytest.raises(ValueError, match=r"bft_options\.json: unknown BFT options \['colour'\]"):
        LlamaForCausalLM.from_pretrained(tmp_path)


def test_a_new_export_replaces_the_files_of_an_earlier_one(tmp_path: Path) -> None:
    """Sharded BFT export, then an unsharded plain one into the same directory: the
    earlier shards, index and BFT tensors are gone, and what loads is the new model."""
    _bft_model(seed=1).save_pretrained(tmp_path, max_shard_bytes=4096)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items()})
    torch.manual_seed(2)
    plain = LlamaForCausalLM(cfg).eval()
    plain.save_pretrained(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["bft_options.json", "config.json", "model.safetensors"]
    back = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert back.bft.precision == "off"
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, plain(ids).logits, atol=0, rtol=0)


def _failing_after(calls: int, real):  # type: ignore[no-untyped-def]
    """``real`` that raises on its ``calls``-th call (a full disk, a kill)."""
    count = []

    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        count.append(1)
        if len(count) == calls:
            raise OSError("No space left on device")
        return real(*args, **kwargs)

    return call


def test_an_export_that_fails_while_writing_leaves_the_earlier_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    first = _bft_model(seed=1).eval()
    first.save_pretrained(tmp_path, max_shard_bytes=4096)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(
        safetensors.torch, "save_file", _failing_after(3, safetensors.torch.save_file)
    )
    with pytest.raises(OSError, match="No space"):
        _bft_model(seed=2).save_pretrained(tmp_path, max_shard_bytes=4096)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporaries
    back = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, first(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_an_export_interrupted_while_renaming_never_loads_a_mix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """A failure among the renames (after the old config.json is gone) leaves a
    directory that every reader refuses, never one that loads parts of two models;
    the next export then succeeds."""
    import os

    _bft_model(seed=1).save_pretrained(tmp_path, max_shard_bytes=4096)
    second = _bft_model(seed=2, attention_gate="sigmoid").eval()
    monkeypatch.setattr(os, "replace", _failing_after(fail_at, os.replace))
    with pytest.raises(OSError, match="No space"):
        second.save_pretrained(tmp_path)  # unsharded: the old shards and index go too
    monkeypatch.undo()
    assert not list(tmp_path.glob(".bft-tmp-*"))
    with pytest.raises(CheckpointError, match="no config.json.*interrupted, write it again"):
        LlamaForCausalLM.from_pretrained(tmp_path)
    second.save_pretrained(tmp_path)
    back = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, second(ids).logits, atol=0, rtol=0)


def test_a_killed_exports_temporaries_are_swept_by_the_next(tmp_path: Path) -> None:
    orphan = tmp_path / ".bft-tmp-99999-model.safetensors"  # a write killed with SIGKILL
    tmp_path.mkdir(exist_ok=True)
    orphan.write_bytes(b"x" * 1000)
    _bft_model().save_pretrained(tmp_path)
    assert not orphan.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bft.safetensors", "bft_options.json", "config.json", "model.safetensors",
    ]  # fmt: skip


def test_bft_state_of_replaced_llama_files_is_ignored(tmp_path: Path) -> None:
    """Another writer (transformers here) saving into a BFT export leaves our BFT
    files beside weights they do not belong to: they are ignored with a warning."""
    from transformers import LlamaForCausalLM as HF

    _bft_model(seed=1).save_pretrained(tmp_path)
    hf = HF.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        hf.model.embed_tokens.weight.add_(1.0)  # fine-tuned elsewhere
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="written with other Llama files"):
        back = LlamaForCausalLM.from_pretrained(tmp_path)
    assert back.bft.precision == "off" and not back.bft_state_loaded
    torch.testing.assert_close(back.model.embed_tokens.weight, hf.model.embed_tokens.weight)


def test_tokenizer_from_checkpoint_dir(hf_checkpoint: Path) -> None:
    tok = load_tokenizer(hf_checkpoint)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 64)
    ids = tok.encode("w0 w5 w59", bos=True)
    assert ids == [1, 4, 9, 63]
    assert tok.decode(ids) == "w0 w5 w59"


@pytest.mark.parametrize(
    "remove, message",
    [
        ("config.json", "no config.json"),
        ("model-00002-of-", "shards that are missing"),
        ("tokenizer.json", "no tokenizer.json"),
        ("all-weights", "has no weights"),
    ],
)
def test_incomplete_directory_gives_clear_error(
    hf_checkpoint: Path, tmp_path: Path, remove: str, message: str
) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint, d)
    for f in list(d.iterdir()):
        if f.name.startswith(remove) or (remove == "all-weights" and "model" in f.name):
            f.unlink()
    with pytest.raises(CheckpointError, match=message):
        if remove == "tokenizer.json":
            load_tokenizer(d)
        else:
            LlamaForCausalLM.from_pretrained(d)


def test_missing_directory_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        LlamaForCausalLM.from_pretrained(tmp_path / "nope")


def test_unsupported_rope_scaling_is_refused(hf_checkpoint: Path) -> None:
    cfg = json.loads((hf_checkpoint / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(NotImplementedError, match="llama3"):
        LlamaConfig.from_hf(cfg)
    # a default rope_parameters next to a scaled rope_scaling (transformers applies the latter)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    with pytest.raises(NotImplementedError, match=r"'linear' \(rope_scaling\)"):
        LlamaConfig.from_hf(cfg)


def test_transformers_4_config_layout() -> None:
    cfg = {  # TinyLlama-1.1B's config.json (transformers 4.35)
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 5632,
        "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
        "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
    }  # fmt: skip
    c = LlamaConfig.from_hf(cfg)
    assert (c.hidden_size, c.num_key_value_heads, c.head_dim, c.rope_theta) == (2048, 4, 64, 1e4)


def _sentencepiece_style(tmp_path: Path, scheme: str) -> Path:
    """A small BPE with Llama 2's start marker: a ``Prepend("▁")`` normalizer (the
    TinyLlama tokenizer.json) or a ``Metaspace(prepend_scheme="first")`` pre-tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if scheme == "prepend":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    corpus = [
        "Paris is the capital of France",
        "Question: who\nAnswer: Paris",
        "Answer: Paris",
    ] * 50
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


@pytest.mark.parametrize("scheme", ["prepend", "metaspace"])
def test_segments_encode_as_continuations_of_running_text(tmp_path, scheme) -> None:
    """Prompt and answer are encoded apart and joined: each must read as it does inside
    running text (``▁Paris`` after ``Answer:``), not as the start of an input, which a
    sentencepiece-style tokenizer marks with its own ``▁``; the saved file is unchanged."""
    from tokenizers import Tokenizer

    path = _sentencepiece_style(tmp_path, scheme)
    tok = load_tokenizer(path)
    raw = Tokenizer.from_file(str(path))

    def pieces(ids: list[int]) -> list[str]:
        return [raw.id_to_token(i) for i in ids]

    assert pieces(tok.encode(" Paris")) == ["▁Paris"]  # as after "Answer:" in running text
    assert not pieces(tok.encode("Answer:"))[0].startswith("▁")  # as after "\n"
    assert pieces(raw.encode("Answer:", add_special_tokens=False).ids)[0].startswith("▁")
    if scheme == "prepend":  # the file's own encoding of a segment carries a second marker
        assert pieces(raw.encode(" Paris", add_special_tokens=False).ids)[0] == "▁"
    for text in ("Answer:", "Paris is the capital"):  # a document's start keeps the marker
        assert tok.encode(text, start=True) == raw.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, bos=True)[1:] == tok.encode(text, start=True)
    tok.save(tmp_path / "again.json")  # the saved tokenizer is the file's, marker and all
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads(path.read_text())


def test_prompt_reads_like_running_text_with_a_sentencepiece_tokenizer(tmp_path) -> None:
    """BOS, the first passage as a document start (with its marker), then the
    question and the answer as continuations: no stray start markers inside."""
    from tokenizers import Tokenizer

    from bft_lightning.lm.data.qa import Passage, QAExample, encode_example

    path = _sentencepiece_style(tmp_path, "prepend")
    tok, raw = load_tokenizer(path), Tokenizer.from_file(str(path))
    gold = Passage("Paris is the capital of France")
    ex = QAExample("q1", "who is it", ["Paris"], [gold], "g", answer_start=0)
    enc = encode_example(ex, tok, [gold], max_length=64, max_answer_tokens=8)
    assert enc is not None
    first = raw.encode(gold.text, add_special_tokens=False).ids
    assert enc.prompt[: 1 + len(first)] == [tok.bos_id, *first]
    assert [raw.id_to_token(i) for i in enc.answer[:-1]] == ["▁Paris"]
    assert enc.answer[-1] == tok.eos_id
