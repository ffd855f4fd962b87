"""Bad hyperparameters, config values and LM checkpoint folders: one clear error each.

Three tables, each row a bad input and the message it must get (a regex that
names the field, file or tensor):

- ``HYPER``: the options of every public constructor (layers, priors,
  backbones, the Llama config and BFT options, tasks, data modules), checked
  where they are declared, before anything is built;
- ``CONFIG``: the same values given in a YAML file or on the command line,
  parsed by the CLI in-process (``run=False``): the field is named;
- ``LM``: a small Llama-format folder damaged one way per row, loaded with
  ``LlamaForCausalLM.from_pretrained``: every size, shape, dtype and value is
  checked before the model is allocated (a ``vocab_size`` of 10**12 would ask
  for terabytes) and the error names the ``config.json`` field, the tensor or
  the file.

Every row also checks that nothing was written (the working folder stays
empty) and nothing lost (the input files are byte-for-byte unchanged).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.lm.data.qa import QADataModule, QAPretrainDataModule
from bft_lightning.lm.llama_format import CheckpointError
from bft_lightning.lm.model import BFTOptions, LlamaConfig, LlamaForCausalLM
from bft_lightning.lm.task import LanguageSFT
from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.nn import BFTEncoder, BFTEncoderLayer, MLPPrecisionPrior, PrecisionPrior
from bft_lightning.nn.decoder import BFTLlamaDecoderLayer
from bft_lightning.nn.filter import FilterConfig
from bft_lightning.nn.hstu import HSTUEncoder, HSTULayer, RelativeAttentionBias
from bft_lightning.tasks import SequentialRecommendation

pytestmark = pytest.mark.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[1]
SASREC = REPO / "configs" / "experiments" / "sasrec_on_synthetic.yaml"
SMALL_LLAMA = dict(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Path], object]  # given the input folder
    message: str  # regex; "{in}" stands for the input folder
    error: type[BaseException] = ValueError


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def refused(case: Case, inp: Path, work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``case`` in an empty working folder; check error, message, nothing written or lost."""
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    before = snapshot(inp)
    with warnings.catch_warnings(), pytest.raises(case.error) as info:
        warnings.simplefilter("ignore")
        case.run(inp)
    pattern = case.message.replace("{in}", re.escape(str(inp)))
    assert re.search(pattern, str(info.value)), f"{info.value}\n!~ {pattern}"
    assert snapshot(inp) == before  # nothing lost or changed
    assert not list(work.rglob("*"))  # nothing written


def c(name: str, build: Callable[[], object], message: str) -> Case:
    return Case(name, lambda inp: build(), message)


# ---------------------------------------------------------------- hyperparameters
HYPER = [
    # BFTEncoderLayer
    c("layer_d_model_0", lambda: BFTEncoderLayer(0, 2), r"d_model must be an integer >= 1, got 0"),
    c("layer_d_model_float", lambda: BFTEncoderLayer(16.0, 2), r"d_model must be an integer"),
    c("layer_nhead_0", lambda: BFTEncoderLayer(16, 0), r"nhead must be an integer >= 1, got 0"),
    c("layer_nhead_3", lambda: BFTEncoderLayer(16, 3),
      r"nhead must divide d_model=16, got nhead=3"),
    c("layer_ffn_0", lambda: BFTEncoderLayer(16, 2, 0), r"dim_feedforward must be an integer >= 1"),
    c("layer_dropout_1", lambda: BFTEncoderLayer(16, 2, dropout=1.0),
      r"dropout must be in \[0, 1\), got 1.0"),
    c("layer_dropout_neg", lambda: BFTEncoderLayer(16, 2, dropout=-0.1), r"dropout must be in"),
    c("layer_dropout_nan", lambda: BFTEncoderLayer(16, 2, dropout=float("nan")),
      r"dropout must be in \[0, 1\), got nan"),
    c("layer_q_init_neg", lambda: BFTEncoderLayer(16, 2, q_init=-0.1),
      r"q_init must be a finite number > 0, got -0.1"),
    c("layer_q_init_0", lambda: BFTEncoderLayer(16, 2, q_init=0.0), r"q_init must be .* > 0"),
    c("layer_q_init_inf", lambda: BFTEncoderLayer(16, 2, q_init=float("inf")), r"q_init must be"),
    c("layer_nu0_neg", lambda: BFTEncoderLayer(16, 2, nu0=-1.0), r"nu0 must be .* >= 0"),
    c("layer_sill_momentum_2", lambda: BFTEncoderLayer(16, 2, sill_momentum=2.0),
      r"sill_momentum must be in \[0, 1\], got 2.0"),
    c("layer_eps_0", lambda: BFTEncoderLayer(16, 2, layer_norm_eps=0.0), r"layer_norm_eps must be"),
    c("layer_chunk_0", lambda: BFTEncoderLayer(16, 2, attention_chunk=0),
      r"attention_chunk must be an integer >= 1"),
    c("layer_groups_3", lambda: BFTEncoderLayer(16, 2, groups=3), r"groups=3 must be a positive"),
    c("layer_groups_float", lambda: BFTEncoderLayer(16, 2, groups=2.0),
      r"groups=2.0 must be a positive divisor of d_model=16"),
    c("layer_d_model_bool", lambda: BFTEncoderLayer(True, 1), r"d_model must be an integer"),
    c("layer_dropout_str", lambda: BFTEncoderLayer(16, 2, dropout="0.1"),
      r"dropout must be in \[0, 1\), got '0.1'"),
    c("layer_precision", lambda: BFTEncoderLayer(16, 2, precision="yes"), r"precision must be"),
    # BFTEncoder
    c("encoder_layers_0", lambda: BFTEncoder(BFTEncoderLayer(16, 2, 32), 0),
      r"num_layers must be an integer >= 1, got 0"),
    c("encoder_layers_float", lambda: BFTEncoder(BFTEncoderLayer(16, 2, 32), 2.5),
      r"num_layers must be an integer"),
    # priors
    c("prior_num_embeddings_0", lambda: PrecisionPrior(0),
      r"num_embeddings must be an integer >= 1"),
    c("prior_width_0", lambda: PrecisionPrior(10, width=0), r"width must be an integer >= 1"),
    c("prior_padding_idx", lambda: PrecisionPrior(10, padding_idx=10),
      r"padding_idx must be None or in \[0, num_embeddings=10\), got 10"),
    c("prior_scale_0", lambda: PrecisionPrior(10, scale=0.0), r"prior scale c must be positive"),
    c("mlp_prior_hidden_0", lambda: MLPPrecisionPrior(16, hidden=0), r"hidden must be an integer"),
    c("mlp_prior_d_model_0", lambda: MLPPrecisionPrior(0), r"d_model must be an integer >= 1"),
    # HSTU layer and encoder
    c("hstu_nhead_0", lambda: HSTULayer(16, 0, 8), r"nhead must be an integer >= 1, got 0"),
    c("hstu_nhead_3", lambda: HSTULayer(16, 3, 8), r"nhead must divide d_model=16"),
    c("hstu_max_len_0", lambda: HSTULayer(16, 2, 0), r"max_len must be an integer >= 1, got 0"),
    c("hstu_linear_dim_0", lambda: HSTULayer(16, 2, 8, linear_dim=0), r"linear_dim must be"),
    c("hstu_dropout_1", lambda: HSTULayer(16, 2, 8, dropout=1.0), r"dropout must be in \[0, 1\)"),
    c("hstu_q_init_neg", lambda: HSTULayer(16, 2, 8, config=FilterConfig(q_init=-1.0)),
      r"q_init must be"),
    c("hstu_buckets_0", lambda: HSTULayer(16, 2, 8, num_buckets=0), r"num_buckets must be"),
    c("rab_buckets_0", lambda: RelativeAttentionBias(8, 0), r"num_buckets must be an integer"),
    c("sasrec_num_items_float", lambda: SASRec(10.5), r"num_items must be an integer >= 1"),
    c("hstu_encoder_layers_0", lambda: HSTUEncoder(HSTULayer(16, 2, 8), 0), r"num_layers must be"),
    # Llama decoder layer
    c("decoder_d_ff_0", lambda: BFTLlamaDecoderLayer(16, 4, d_ff=0),
      r"d_ff must be an integer >= 1"),
    c("decoder_heads_0", lambda: BFTLlamaDecoderLayer(16, 0), r"n_heads must be an integer >= 1"),
    c("decoder_heads_3", lambda: BFTLlamaDecoderLayer(16, 3), r"n_heads must divide d_model=16"),
    c("decoder_kv_heads_3", lambda: BFTLlamaDecoderLayer(16, 4, n_kv_heads=3),
      r"n_kv_heads must divide n_heads=4, got n_kv_heads=3"),
    c("decoder_groups_5", lambda: BFTLlamaDecoderLayer(16, 4, config=FilterConfig(groups=5)),
      r"groups=5 must be a positive divisor of d_model=16"),
    c("decoder_dropout_1", lambda: BFTLlamaDecoderLayer(16, 4, dropout=1.0), r"dropout must be in"),
    c("decoder_q_init_neg", lambda: BFTLlamaDecoderLayer(16, 4, config=FilterConfig(q_init=-0.5)),
      r"q_init must be"),
    c("decoder_eps_neg", lambda: BFTLlamaDecoderLayer(16, 4, rms_norm_eps=-1e-6),
      r"rms_norm_eps must be"),
    # backbones
    c("sasrec_d_model_0", lambda: SASRec(10, d_model=0), r"d_model must be an integer >= 1, got 0"),
    c("sasrec_dropout_1", lambda: SASRec(10, dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    c("sasrec_ffn_0", lambda: SASRec(10, dim_feedforward=0), r"dim_feedforward must be an integer"),
    c("sasrec_nhead_0", lambda: SASRec(10, nhead=0), r"nhead must be an integer >= 1, got 0"),
    c("sasrec_nhead_5", lambda: SASRec(10, nhead=5), r"nhead must divide d_model=64, got nhead=5"),
    c("sasrec_q_init_neg", lambda: SASRec(10, precision="on", q_init=-0.01), r"q_init must be"),
    c("sasrec_layers_0", lambda: SASRec(10, num_layers=0), r"num_layers must be an integer >= 1"),
    c("sasrec_prior_scale_neg", lambda: SASRec(10, precision="on", prior_scale=-1.0),
      r"prior_scale must be .* > 0 or None, got -1.0"),
    c("sasrec_prior_width_0", lambda: SASRec(10, precision="on", prior_width=0),
      r"prior_width must be an integer >= 1"),
    c("sasrec_num_items_0", lambda: SASRec(0), r"num_items must be >= 1, got 0"),
    c("bert4rec_dropout_1", lambda: BERT4Rec(10, dropout=1.0), r"dropout must be in \[0, 1\)"),
    c("bert4rec_mask_prob_0", lambda: BERT4Rec(10, mask_prob=0.0),
      r"mask_prob must be in \(0, 1\]"),
    c("hstu_model_nhead_0", lambda: HSTU(10, nhead=0), r"nhead must be an integer >= 1, got 0"),
    c("hstu_model_d_model_neg", lambda: HSTU(10, d_model=-8), r"d_model must be an integer >= 1"),
    # Llama config and BFT options
    c("llama_vocab_0", lambda: LlamaConfig(vocab_size=0), r"vocab_size must be an integer >= 1"),
    c("llama_vocab_float", lambda: LlamaConfig(vocab_size=1e12), r"vocab_size must be an integer"),
    c("llama_hidden_0", lambda: LlamaConfig(hidden_size=0), r"hidden_size must be an integer"),
    c("llama_heads_0", lambda: LlamaConfig(num_attention_heads=0),
      r"num_attention_heads must be an integer >= 1"),
    c("llama_heads_3", lambda: LlamaConfig(num_attention_heads=3, num_key_value_heads=1),
      r"num_attention_heads must divide hidden_size=2048"),
    c("llama_kv_heads_5", lambda: LlamaConfig(num_key_value_heads=5),
      r"num_attention_heads=32 must be a multiple of num_key_value_heads=5"),
    c("llama_layers_0", lambda: LlamaConfig(num_hidden_layers=0), r"num_hidden_layers must be"),
    c("llama_eps_0", lambda: LlamaConfig(rms_norm_eps=0.0), r"rms_norm_eps must be .* > 0"),
    c("llama_theta_neg", lambda: LlamaConfig(rope_theta=-1.0), r"rope_theta must be"),
    c("llama_eos_out_of_vocab", lambda: LlamaConfig(vocab_size=100, eos_token_id=100),
      r"eos_token_id must be None or an id in \[0, vocab_size=100\), got 100"),
    c("bft_dropout_1", lambda: BFTOptions(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    c("bft_q_init_neg", lambda: BFTOptions(filter=FilterConfig(q_init=-1.0)),
      r"q_init must be a finite number > 0"),
    c("bft_precision", lambda: BFTOptions(filter=FilterConfig(precision="true")),
      r"precision must be one of"),
    c("bft_groups_0", lambda: BFTOptions(filter=FilterConfig(groups=0)),
      r"groups must be an integer >= 1 or None"),
    c("bft_prior_scale_0", lambda: BFTOptions(prior_scale=0.0), r"prior_scale must be"),
    c("bft_impl", lambda: BFTOptions(filter=FilterConfig(attention_impl="flash")),
      r"attention_impl must be one of"),
    # tasks
    c("task_lr_neg", lambda: SequentialRecommendation(10, lr=-1.0), r"lr must be >= 0, got -1.0"),
    c("task_negatives_0", lambda: SequentialRecommendation(10, num_negatives=0),
      r"num_negatives must be an integer >= 1"),
    c("task_temperature_0", lambda: SequentialRecommendation(10, temperature=0.0),
      r"temperature must be > 0"),
    c("task_ks_0", lambda: SequentialRecommendation(10, ks=(0, 10)),
      r"ks must be a non-empty list of integers >= 1, got \(0, 10\)"),
    c("task_ks_empty", lambda: SequentialRecommendation(10, ks=()), r"ks must be a non-empty"),
    c("sft_gamma_neg", lambda: LanguageSFT(LlamaConfig(**SMALL_LLAMA), focal_gamma=-1.0),
      r"focal_gamma must be .* >= 0, got -1.0"),
    c("sft_target_gain_1", lambda: LanguageSFT(LlamaConfig(**SMALL_LLAMA), target_gain=1.0),
      r"target_gain must be in \(0, 1\), got 1.0"),
    c("sft_max_new_tokens_0", lambda: LanguageSFT(LlamaConfig(**SMALL_LLAMA), max_new_tokens=0),
      r"max_new_tokens must be an integer >= 1"),
    c("sft_warmup_neg", lambda: LanguageSFT(LlamaConfig(**SMALL_LLAMA), warmup_steps=-1),
      r"warmup_steps must be an integer >= 0"),
    c("sft_lr_nan", lambda: LanguageSFT(LlamaConfig(**SMALL_LLAMA), lr=float("nan")),
      r"lr must be a finite number >= 0, got nan"),
    # data modules (options only, no files read)
    c("seqdm_batch_0", lambda: SequenceDataModule(batch_size=0),
      r"SequenceDataModule: batch_size must be an integer >= 1, got 0"),
    c("seqdm_max_len_0", lambda: SequenceDataModule(max_len=0), r"max_len must be an integer >= 1"),
    c("seqdm_seed_neg", lambda: SequenceDataModule(seed=-1), r"seed must be an integer >= 0"),
    c("seqdm_train_rows", lambda: SequenceDataModule(train_rows="items"), r"train_rows must be"),
    c("qadm_noise_rate", lambda: QADataModule(noise_rate=1.5), r"noise_rate must be in \[0, 1\]"),
    c("qadm_max_length_0", lambda: QADataModule(max_length=0), r"max_length must be an integer"),
    c("qadm_distractors_neg", lambda: QADataModule(num_distractors=-1),
      r"num_distractors must be an integer >= 0, got -1"),
    c("qadm_val_groups_fraction", lambda: QADataModule(val_groups=1.5),
      r"val_groups must be in \[0, 1\), got 1.5"),
    c("qadm_test_groups_neg", lambda: QADataModule(test_groups=-2),
      r"test_groups must be an integer >= 0"),
    c("qadm_answer_tokens_neg", lambda: QADataModule(max_answer_tokens=-1),
      r"max_answer_tokens must be an integer >= 0, got -1"),
    c("qadm_batch_0", lambda: QADataModule(batch_size=0), r"batch_size must be an integer >= 1"),
    c("qadm_max_train_0", lambda: QADataModule(max_train_examples=0),
      r"max_train_examples must be an integer >= 1 or None, got 0"),
    c("qadm_dataset", lambda: QADataModule(dataset="squad3"), r"dataset must be one of"),
    c("qa_pretrain_seq_len_1", lambda: QAPretrainDataModule(seq_len=1),
      r"seq_len must be an integer >= 2"),
    c("qa_pretrain_fraction_0", lambda: QAPretrainDataModule(train_fraction=0.0),
      r"train_fraction must be in \(0, 1\]"),
]  # fmt: skip


@pytest.mark.parametrize("case", HYPER, ids=lambda x: x.name)
def test_bad_hyperparameter_names_the_field(case, tmp_path, monkeypatch):
    inp = tmp_path / "in"
    inp.mkdir()
    refused(case, inp, tmp_path / "work", monkeypatch)


# ---------------------------------------------------------------- config values (YAML, CLI)
def yaml_case(name: str, yaml: str, message: str, *args: str) -> Case:
    def run(inp: Path) -> object:
        from bft_lightning.cli import main

        (inp / "bad.yaml").write_text(yaml, encoding="utf-8")
        return main(
            ["--config", str(SASREC), "--config", str(inp / "bad.yaml"), *args,
             "--data.init_args.synthetic_users=50", "--trainer.logger=false",
             "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]"],
            run=False,
        )  # fmt: skip

    return Case(name, run, message, BaseException)


def backbone(**values: object) -> str:
    lines = "".join(f"        {k}: {v}\n" for k, v in values.items())
    return f"model:\n  init_args:\n    backbone:\n      init_args:\n{lines}"


def task(**values: object) -> str:
    return "model:\n  init_args:\n" + "".join(f"    {k}: {v}\n" for k, v in values.items())


def data(**values: object) -> str:
    return "data:\n  init_args:\n" + "".join(f"    {k}: {v}\n" for k, v in values.items())


CONFIG = [
    yaml_case("yaml_dropout_1", backbone(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    yaml_case("yaml_d_model_0", backbone(d_model=0), r"d_model must be an integer >= 1, got 0"),
    yaml_case("yaml_nhead_3", backbone(nhead=3), r"nhead must divide d_model=64, got nhead=3"),
    yaml_case("yaml_ffn_0", backbone(dim_feedforward=0), r"dim_feedforward must be an integer"),
    yaml_case("yaml_q_init_neg", backbone(q_init=-0.1), r"q_init must be a finite number > 0"),
    yaml_case("yaml_lr_neg", task(lr=-0.001), r"lr must be >= 0, got -0.001"),
    yaml_case("yaml_batch_0", data(batch_size=0), r"batch_size must be an integer >= 1, got 0"),
    yaml_case("cli_groups_5", "{}\n", r"groups=5 must be a positive divisor of d_model=64",
              "--model.init_args.backbone.init_args.groups=5"),
]  # fmt: skip


@pytest.mark.parametrize("case", CONFIG, ids=lambda x: x.name)
def test_bad_config_value_names_the_field(case, tmp_path, monkeypatch, capsys):
    inp = tmp_path / "in"
    inp.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with warnings.catch_warnings(), pytest.raises(BaseException) as info:
        warnings.simplefilter("ignore")
        case.run(inp)
    said = f"{info.value}\n{capsys.readouterr().err}"
    assert re.search(case.message, said), f"{said[-2000:]}\n!~ {case.message}"
    assert not list(work.rglob("*"))  # no logs, checkpoints or config copies


# ---------------------------------------------------------------- LM checkpoint folders
@pytest.fixture(scope="module")
def lm_source(tmp_path_factory) -> Path:
    """A small BFT Llama saved in two shards (index + shards + BFT files)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(**SMALL_LLAMA), BFTOptions(filter=FilterConfig(precision="on"))
    )
    out = tmp_path_factory.mktemp("lm_source")
    model.save_pretrained(out, max_shard_bytes=8_000)
    return out


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())


def _config(folder: Path, **changes: object) -> None:
    file = folder / "config.json"
    config = json.loads(file.read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    file.write_text(json.dumps(config))


def _index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _shard_of(folder: Path, tensor: str) -> Path:
    return folder / _index(folder)["weight_map"][tensor]


def _rewrite_tensor(folder: Path, tensor: str, change: Callable[[torch.Tensor], torch.Tensor]):
    from safetensors.torch import load_file, save_file

    shard = _shard_of(folder, tensor)
    tensors = load_file(str(shard))
    tensors[tensor] = change(tensors[tensor])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _drop_tensor(folder: Path, tensor: str) -> None:
    from safetensors.torch import load_file, save_file

    shard = _shard_of(folder, tensor)
    tensors = load_file(str(shard))
    del tensors[tensor]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = _index(folder)
    del index["weight_map"][tensor]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


def _inf(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("-inf")
    return t


def _truncate(folder: Path) -> None:
    shard = _shard_of(folder, "model.embed_tokens.weight")
    shard.write_bytes(shard.read_bytes()[:-40])


def _bad_header(folder: Path) -> None:
    shard = _shard_of(folder, "model.embed_tokens.weight")
    body = shard.read_bytes()
    (n,) = struct.unpack("<Q", body[:8])
    shard.write_bytes(body[:8] + b"{not json" + b" " * (n - 9) + body[8 + n :])


def _index_missing_shard(folder: Path) -> None:
    index = _index(folder)
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_wrong_shard(folder: Path) -> None:
    index = _index(folder)
    shards = sorted(set(index["weight_map"].values()))
    name = "model.norm.weight"
    index["weight_map"][name] = next(s for s in shards if s != index["weight_map"][name])
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


EMB = "model.embed_tokens.weight"
LM: list[tuple[str, Callable[[Path], None], str, type[BaseException]]] = [
    ("vocab_1e12", lambda f: _config(f, vocab_size=10**12),
     r"{in}/config.json: vocab_size=1000000000000 does not match tensor "
     r"model.embed_tokens.weight of shape \(32, 16\)", ValueError),
    ("vocab_float", lambda f: _config(f, vocab_size=1e12),
     r"{in}/config.json: vocab_size must be an integer >= 1, got 1000000000000.0", ValueError),
    ("hidden_size_mismatch", lambda f: _config(f, hidden_size=32, num_attention_heads=8),
     r"{in}/config.json: hidden_size=32 does not match tensor model.embed_tokens.weight",
     ValueError),
    ("intermediate_size_mismatch", lambda f: _config(f, intermediate_size=10**9),
     r"{in}/config.json: intermediate_size=1000000000 does not match tensor "
     r"model.layers.0.mlp.gate_proj.weight", ValueError),
    ("kv_heads_mismatch", lambda f: _config(f, num_key_value_heads=4),
     r"{in}/config.json: num_key_value_heads x head_dim=4 x 4 does not match tensor "
     r"model.layers.0.self_attn.k_proj.weight", ValueError),
    ("layers_mismatch", lambda f: _config(f, num_hidden_layers=10**6),
     r"{in}/config.json: num_hidden_layers=1000000 does not match the weights .* hold 2 layers",
     ValueError),
    ("heads_zero", lambda f: _config(f, num_attention_heads=0),
     r"{in}/config.json: num_attention_heads must be an integer >= 1, got 0", ValueError),
    ("config_not_json", _write("config.json", '{"vocab_size": 32,'),
     r"{in}/config.json: not valid JSON", ValueError),
    ("config_a_list", _write("config.json", "[1, 2]"),
     r"{in}/config.json: expected a JSON object, got list", ValueError),
    ("missing_tensor", lambda f: _drop_tensor(f, "model.layers.1.mlp.down_proj.weight"),
     r"the weights do not match config.json: missing tensors "
     r"\['model.layers.1.mlp.down_proj.weight'\]", ValueError),
    ("nan_weight", lambda f: _rewrite_tensor(f, "model.layers.0.self_attn.q_proj.weight", _nan),
     r"{in}/model-\d{5}-of-\d{5}.safetensors: tensor model.layers.0.self_attn.q_proj.weight "
     r"holds 1 NaN or inf values", ValueError),
    ("inf_weight", lambda f: _rewrite_tensor(f, "model.norm.weight", _inf),
     r"tensor model.norm.weight holds 1 NaN or inf values", ValueError),
    ("int_weight", lambda f: _rewrite_tensor(f, EMB, lambda t: t.round().to(torch.int32)),
     r"{in}/model-\d{5}-of-\d{5}.safetensors: tensor model.embed_tokens.weight has dtype I32; "
     r"Llama weights must be floating point", ValueError),
    ("bool_weight", lambda f: _rewrite_tensor(f, "model.norm.weight", lambda t: t > 0),
     r"tensor model.norm.weight has dtype BOOL", ValueError),
    ("malformed_header", _bad_header,
     r"{in}/model-\d{5}-of-\d{5}.safetensors: not a readable safetensors file", ValueError),
    ("truncated_shard", _truncate,
     r"{in}/model-\d{5}-of-\d{5}.safetensors: not a readable safetensors file", ValueError),
    ("empty_shard", lambda f: _shard_of(f, EMB).write_bytes(b""),
     r"{in}/model-\d{5}-of-\d{5}.safetensors: not a readable safetensors file", ValueError),
    ("index_missing_shard", _index_missing_shard,
     r"model.safetensors.index.json lists shards that are missing: "
     r"\['model-00009-of-00009.safetensors'\]", CheckpointError),
    ("index_wrong_shard", _index_wrong_shard,
     r"{in}/model.safetensors.index.json: places tensor model.norm.weight in "
     r"model-\d{5}-of-\d{5}.safetensors, but it is in", ValueError),
    ("index_not_json", _write("model.safetensors.index.json", "{"),
     r"{in}/model.safetensors.index.json: not valid JSON", ValueError),
    ("index_weight_map_list", _write("model.safetensors.index.json", '{"weight_map": [1]}'),
     r"{in}/model.safetensors.index.json: weight_map must be a JSON object", ValueError),
    ("index_outside_folder", lambda f: _write(
        "model.safetensors.index.json",
        json.dumps({"weight_map": {EMB: "../elsewhere.safetensors"}}))(f),
     r"weight_map names files outside the folder: \['../elsewhere.safetensors'\]", ValueError),
    ("bft_options_bad_value", lambda f: _config_bft(f, dropout=1.0),
     r"{in}/bft_options.json: dropout must be in \[0, 1\), got 1.0", ValueError),
    ("bft_options_unknown", lambda f: _config_bft(f, sigma=2),
     r"{in}/bft_options.json: unknown BFT options \['sigma'\]", ValueError),
    ("bft_tensors_nan", lambda f: _bft_tensor(f, _nan),
     r"{in}/bft.safetensors: tensor model.prior.log_tau.weight holds 1 NaN or inf", ValueError),
    ("bft_tensors_int", lambda f: _bft_tensor(f, lambda t: t.round().to(torch.int32)),
     r"{in}/bft.safetensors: tensor model.prior.log_tau.weight has dtype torch.int32", ValueError),
    ("bin_not_a_pickle", lambda f: _to_bin(f, b"not a torch file"),
     r"{in}/pytorch_model.bin: the weights do not load", ValueError),
    ("bin_nan", lambda f: _to_bin(f, nan="model.layers.1.mlp.up_proj.weight"),
     r"{in}/pytorch_model.bin: tensor model.layers.1.mlp.up_proj.weight holds 1 NaN", ValueError),
    ("bin_vocab_mismatch", lambda f: (_to_bin(f), _config(f, vocab_size=10**12)),
     r"{in}/config.json: vocab_size=1000000000000 does not match tensor "
     r"model.embed_tokens.weight of shape \(32, 16\) in pytorch_model.bin", ValueError),
    ("no_config", lambda f: (f / "config.json").unlink(),
     r"has no config.json; found: .*model.safetensors.index.json", CheckpointError),
]  # fmt: skip


def _to_bin(folder: Path, content: bytes | None = None, nan: str | None = None) -> None:
    """The same weights as a legacy ``pytorch_model.bin`` (no BFT files, no shards)."""
    from bft_lightning.lm.llama_format import read_state_dict

    state = read_state_dict(folder)
    for p in folder.iterdir():
        if p.name.endswith((".safetensors", ".index.json")) or p.name == "bft_options.json":
            p.unlink()
    if nan is not None:
        state[nan] = _nan(state[nan])
    if content is not None:
        (folder / "pytorch_model.bin").write_bytes(content)
    else:
        torch.save(state, folder / "pytorch_model.bin")


def _config_bft(folder: Path, **changes: object) -> None:
    file = folder / "bft_options.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def _bft_tensor(folder: Path, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    file = folder / "bft.safetensors"
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(file))
    tensors["model.prior.log_tau.weight"] = change(tensors["model.prior.log_tau.weight"])
    save_file(tensors, str(file), metadata=meta)  # same size: the fingerprint still matches


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"tie_word_embeddings": True},
        {"attention_bias": True, "mlp_bias": True},
        {"head_dim": 8},
    ],  # fmt: skip
)
def test_the_shapes_checked_are_the_models_own(changes):
    """``llama_tensor_shapes`` (the sizes checked before allocating) equals the
    Llama part of the state dict of the model the config builds."""
    from bft_lightning.lm.model import is_bft_key, llama_tensor_shapes

    config = LlamaConfig(**{**SMALL_LLAMA, **changes})
    with torch.device("meta"):
        model = LlamaForCausalLM(
            config, BFTOptions(filter=FilterConfig(precision="on", attention_gate="sigmoid"))
        )
    own = {k: tuple(v.shape) for k, v in model.state_dict().items() if not is_bft_key(k)}
    if config.tie_word_embeddings:
        own.pop("lm_head.weight")
    assert llama_tensor_shapes(config) == own


def test_the_small_llama_loads_when_undamaged(lm_source, tmp_path):
    """The control: the folder the LM rows damage loads, and gives the saved model's logits."""
    _copy(lm_source, tmp_path / "lm")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "lm")
    again = LlamaForCausalLM.from_pretrained(lm_source)
    ids = torch.tensor([[1, 5, 7, 9]])
    assert model.bft.precision == "on" and model.bft_state_loaded
    torch.testing.assert_close(model(ids).logits, again(ids).logits)


def test_the_legacy_bin_layout_loads_when_undamaged(lm_source, tmp_path):
    """The control of the ``pytorch_model.bin`` rows: the same Llama weights load."""
    _copy(lm_source, tmp_path / "lm")
    _to_bin(tmp_path / "lm")
    ids = torch.tensor([[1, 5, 7, 9]])
    plain = LlamaForCausalLM.from_pretrained(lm_source, BFTOptions())
    torch.testing.assert_close(
        LlamaForCausalLM.from_pretrained(tmp_path / "lm")(ids).logits, plain(ids).logits
    )


@pytest.mark.parametrize("row", LM, ids=lambda r: r[0])
def test_bad_lm_folder_is_refused_before_allocating(row, lm_source, tmp_path, monkeypatch):
    name, damage, message, error = row
    inp = tmp_path / "in"
    _copy(lm_source, inp)
    damage(inp)
    case = Case(name, lambda folder: LlamaForCausalLM.from_pretrained(folder), message, error)

    def allocate(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was allocated before the folder was checked")

    monkeypatch.setattr(LlamaForCausalLM, "to_empty", allocate)  # every check comes first
    refused(case, inp, tmp_path / "work", monkeypatch)


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(28)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


TOKENIZER: list[tuple[str, Callable[[Path], None], str]] = [
    ("tokenizer_not_json", _write("tokenizer.json", "{"),
     r"{in}/tokenizer.json: not a readable tokenizer.json"),
    ("tokenizer_a_list", _write("tokenizer.json", "[]"),
     r"{in}/tokenizer.json: not a readable tokenizer.json"),
    ("tokenizer_eos_outside", lambda f: _config(f, eos_token_id=40),
     r"{in}/tokenizer.json: eos_token_id=40 \(config.json\) is not one of the tokenizer's 32 ids"),
    ("tokenizer_pad_negative", lambda f: _config(f, pad_token_id=-1),
     r"{in}/tokenizer.json: pad_token_id=-1 \(config.json\) is not one of"),
]  # fmt: skip


def test_the_small_tokenizer_loads_when_undamaged(lm_source, tmp_path):
    from bft_lightning.lm.llama_format import load_tokenizer

    _copy(lm_source, tmp_path / "lm")
    _tokenizer(tmp_path / "lm")
    tok = load_tokenizer(tmp_path / "lm")
    assert (tok.bos_id, tok.eos_id) == (1, 2)


@pytest.mark.parametrize("row", TOKENIZER, ids=lambda r: r[0])
def test_bad_tokenizer_is_refused(row, lm_source, tmp_path, monkeypatch):
    from bft_lightning.lm.llama_format import load_tokenizer

    name, damage, message = row
    inp = tmp_path / "in"
    _copy(lm_source, inp)
    _tokenizer(inp)
    damage(inp)
    refused(Case(name, load_tokenizer, message), inp, tmp_path / "work", monkeypatch)


def test_the_tables_are_large_enough():
    names = [x.name for x in HYPER + CONFIG] + [r[0] for r in LM + TOKENIZER]
    assert len(names) >= 45 and len(set(names)) == len(names)
