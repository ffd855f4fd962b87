"""Bad inputs stop with a clear error naming the file, line or field; nothing is written or lost.

Every row of ``BAD`` writes its inputs under ``in/``, runs the user-facing
entry point (``SequenceDataModule`` as the CLI builds it, the CLI itself, the
checkpoint loaders), and checks three things: the error type, a message that
names the file (``{in}`` in the pattern is the input folder) with the line, or
the field, and that afterwards ``out/`` (cache, logs, checkpoints, config
copies) holds no file while every input file is byte-for-byte unchanged.

A few inputs look bad but are valid, and are read without loss (the tests at
the end): duplicate timestamps keep file order, huge ids are opaque tokens,
and a damaged cache file is ignored and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch

from bft_lightning.cli import main
from bft_lightning.datamodules import SequenceDataModule
from bft_lightning.lm.llama_format import CheckpointError, load_tokenizer, read_state_dict
from bft_lightning.utils import CheckpointLoadError
from bft_lightning.utils.checkpoint_format import save_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "configs" / "experiments"
SASREC = EXPERIMENTS / "sasrec_on_synthetic.yaml"
TINY = [
    "--data.init_args.synthetic_users=300",
    "--data.init_args.max_len=12",
    "--model.init_args.backbone.init_args.d_model=16",
    "--model.init_args.backbone.init_args.dim_feedforward=32",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.logger=false",
]


class CLIError(Exception):
    """The CLI exited (argument errors): its status and what it printed."""


Setup = Callable[[Path, Path], None]  # (input folder, trained checkpoint)
Run = Callable[[Path, Path], object]  # (input folder, output folder)


@dataclass(frozen=True)
class Bad:
    name: str
    setup: Setup
    run: Run
    error: type[BaseException]
    message: str  # regex; "{in}" is the input folder


def put(folder: Path, name: str, content: str | bytes) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def files(**content: str | bytes) -> Setup:
    """Write ``name=content`` pairs (``__`` in a name is a ``/``, ``_dot_`` a ``.``)."""

    def setup(inp: Path, ckpt: Path) -> None:
        for key, value in content.items():
            put(inp, key.replace("__", "/").replace("_dot_", "."), value)

    return setup


def datamodule(name: str, fmt: str | None = None, **kw: object) -> Run:
    """Build the data as a run does: prepare_data (cache) then setup('fit')."""

    def run(inp: Path, out: Path) -> object:
        opts: dict = {"cache_dir": str(out / "cache"), "max_len": 8, **kw}
        if name:
            opts["path"] = str(inp / name)
        if opts.get("data_root") == "IN":
            opts["data_root"] = str(inp)
        dm = SequenceDataModule(format=fmt, **opts)
        dm.prepare_data()
        dm.setup("fit")
        return dm

    return run


def data_case(name: str, file: str, content: str | bytes, message: str, fmt=None, **kw) -> Bad:
    return Bad(
        name,
        files(**{file.replace("/", "__").replace(".", "_dot_"): content}),
        datamodule(file, fmt, **kw),
        ValueError,
        message,
    )


def cli(*args: str, command: str = "fit", config: Path = SASREC) -> Run:
    """``python -m bft_lightning`` in this process; argument errors become ``CLIError``."""

    def run(inp: Path, out: Path) -> object:
        full = [a.replace("{in}", str(inp)) for a in args]
        argv = [command, "--config", str(config), *TINY, f"--trainer.default_root_dir={out}"]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                return main([*argv, *full] if command != "parse" else [*argv[1:], *full], False)
        except SystemExit as exit_:
            raise CLIError(f"{exit_.code}\n{err.getvalue()}") from None

    return run


def cli_run(*args: str, command: str = "test", config: Path = SASREC) -> Run:
    """Run a subcommand (``test --ckpt_path``): its checks come before anything is written."""

    def run(inp: Path, out: Path) -> object:
        full = [a.replace("{in}", str(inp)) for a in args]
        argv = [command, "--config", str(config), *TINY, f"--trainer.default_root_dir={out}"]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                return main([*argv, *full])
        except SystemExit as exit_:
            raise CLIError(f"{exit_.code}\n{err.getvalue()}") from None

    return run


# ----------------------------------------------------------------------------- checkpoints
def ckpt_from(edit: Callable[[dict], object] | None = None, raw: bytes | None = None) -> Setup:
    """``in/model.ckpt``: the trained checkpoint, edited, or raw bytes."""

    def setup(inp: Path, ckpt: Path) -> None:
        target = inp / "model.ckpt"
        if raw is not None:
            put(inp, "model.ckpt", raw)
        elif edit is None:
            shutil.copy(ckpt, target)
        else:
            checkpoint = torch.load(ckpt, weights_only=True)
            edit(checkpoint)
            save_checkpoint(checkpoint, target)  # sealed again, with a new digest

    return setup


def truncated(inp: Path, ckpt: Path) -> None:
    data = ckpt.read_bytes()
    put(inp, "model.ckpt", data[: len(data) // 2])


def nan_weights(checkpoint: dict) -> None:
    name = next(k for k in checkpoint["state_dict"] if k.endswith("item_emb.weight"))
    checkpoint["state_dict"][name][3, 0] = float("nan")


def language_model_state(checkpoint: dict) -> None:
    from bft_lightning.lm.model import LlamaConfig
    from bft_lightning.lm.task import LanguageSFT

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    checkpoint["state_dict"] = LanguageSFT(config=config).state_dict()
    checkpoint.pop("bft_lightning", None)
    checkpoint["hyper_parameters"] = {"_class_path": "bft_lightning.lm.task.LanguageSFT"}


def foreign_state(checkpoint: dict) -> None:
    """Tensors under other names, no record of where they came from."""
    checkpoint["state_dict"] = {"encoder.weight": torch.zeros(4, 4), "head.bias": torch.zeros(4)}
    checkpoint.pop("bft_lightning", None)
    checkpoint.pop("hyper_parameters", None)


class Payload:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("unpickled code ran",))


def unsafe(inp: Path, ckpt: Path) -> None:
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["callbacks"] = {"x": Payload()}
    torch.save(checkpoint, inp / "model.ckpt")


# ----------------------------------------------------------------------------- language models
LM_CONFIG = {
    "vocab_size": 16,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "eos_token_id": 2,
}


def lm_config_only(inp: Path, ckpt: Path) -> None:
    put(inp, "lm/config.json", json.dumps(LM_CONFIG))


def lm_missing_shard(inp: Path, ckpt: Path) -> None:
    lm_config_only(inp, ckpt)
    index = {
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00002-of-00002.safetensors",
        }
    }
    put(inp, "lm/model.safetensors.index.json", json.dumps(index))
    put(inp, "lm/model-00001-of-00002.safetensors", b"")


def tokenizer_json(folder: Path, words: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(words - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def lm_tokenizer_40(inp: Path, ckpt: Path) -> None:
    tokenizer_json(inp / "tok", 40)


def lm_tokenizer_mismatch(inp: Path, out: Path) -> None:
    from bft_lightning.lm.model import LlamaConfig
    from bft_lightning.lm.task import LanguageSFT

    config = {k: v for k, v in LM_CONFIG.items() if k != "eos_token_id"}
    task = LanguageSFT(config=LlamaConfig(**config))  # a model with 16 ids
    tok = load_tokenizer(inp / "tok" / "tokenizer.json")  # a tokenizer with 40
    task._tokenizer = lambda: tok  # type: ignore[method-assign]  (the data's tokenizer)
    task.setup("fit")


# ----------------------------------------------------------------------------- the table
RB_HEADER = "user_id:token\titem_id:token\ttimestamp:float\n"
BAD = [
    # -- interaction files: malformed lines, ids, sizes, formats
    data_case(
        "malformed_line",
        "s.txt",
        "1 2 3\n\n7\n",
        r"{in}/s.txt:3: expected 'user item1",
        fmt="s3rec",
    ),
    data_case(
        "wrong_field_count",
        "p.txt",
        "1 2\n1 2 3\n",
        r"{in}/p.txt:2: expected 2 fields",
        fmt="pairs",
    ),
    data_case(
        "non_integer_item_id", "s.txt", "1 2 3\n2 x 4\n", r"{in}/s.txt:2: non-integer item id 'x'"
    ),
    data_case(
        "non_integer_user_id", "s.txt", "1 2 3\nu 4 5\n", r"{in}/s.txt:2: non-integer user id 'u'"
    ),
    data_case(
        "fractional_id",
        "p.txt",
        "1 2\n1 2.5\n",
        r"{in}/p.txt:2: non-integer item id '2.5'",
        fmt="pairs",
    ),
    data_case("negative_item_id", "s.txt", "1 2 3\n2 -4 5\n", r"{in}/s.txt:2: negative item id -4"),
    data_case(
        "negative_user_id",
        "p.txt",
        "1 2\n-1 4\n",
        r"{in}/p.txt:2: negative user id -1",
        fmt="pairs",
    ),
    data_case("empty_file", "s.txt", "", r"{in}/s.txt: empty file", fmt="s3rec"),
    data_case("blank_file", "s.txt", "\n  \n\n", r"{in}/s.txt: empty file", fmt="s3rec"),
    data_case(
        "user_with_no_items_json",
        "d.json",
        '{"0": [1, 2, 3], "1": []}',
        r"{in}/d.json: user '1': expected a non-empty list",
        fmt="json",
    ),
    data_case(
        "user_with_no_items_line",
        "s.txt",
        "1 2 3 4\n7\n",
        r"{in}/s.txt:2: expected 'user item1 item2 \.\.\.', got only one field",
        fmt="s3rec",
    ),
    data_case(
        "unknown_format", "s.txt", "1 2 3\n", r"unknown format 'csv' for {in}/s.txt", fmt="csv"
    ),
    data_case("undetectable_format", "s.txt", "a\nb\n", r"{in}/s.txt: cannot detect the format"),
    Bad(
        "missing_file",
        files(),
        datamodule("nope.txt"),
        FileNotFoundError,
        r"interaction file not found: {in}/nope.txt",
    ),
    Bad(
        "directory_instead_of_file",
        files(d__x_dot_txt="1 2 3\n"),
        datamodule("d"),
        ValueError,
        r"{in}/d: is a directory, not an interaction file",
    ),
    Bad(
        "unknown_dataset_name",
        files(),
        datamodule("", dataset="no-such-data", data_root="IN"),
        FileNotFoundError,
        r"unknown dataset 'no-such-data': no folder {in}/no-such-data",
    ),
    Bad(
        "known_dataset_file_missing",
        files(),
        datamodule("", dataset="amazon-beauty-s3rec", data_root="IN"),
        FileNotFoundError,
        r"file not found at {in}/amazon-beauty-s3rec/Beauty.txt",
    ),
    Bad(
        "ambiguous_dataset_folder",
        files(mine__a_dot_txt="1 2 3\n", mine__b_dot_txt="1 2 3\n"),
        datamodule("", dataset="mine", data_root="IN"),
        ValueError,
        r"{in}/mine: expected one interaction file, found \['a.txt', 'b.txt'\]",
    ),
    data_case(
        "too_small_for_evaluation",
        "s.txt",
        "1 5 6\n2 6 7\n",
        r"{in}/s.txt: no user has >= 3 interactions \(2 users, longest history 2\)",
    ),
    data_case(
        "too_small_for_training",
        "s.txt",
        "1 5 6 7\n2 5 6 8\n",
        r"{in}/s.txt: no training rows \(2 users, longest history 3\)",
    ),
    data_case(
        "huge_timestamp",
        "r.inter",
        RB_HEADER + "1\t2\t1\n1\t3\t1e30\n",
        r"{in}/r.inter:3: timestamp '1e30' out of range",
    ),
    data_case(
        "infinite_timestamp",
        "ratings.dat",
        "1::2::5::9\n1::3::5::inf\n",
        r"{in}/ratings.dat:2: non-finite timestamp 'inf'",
    ),
    data_case(
        "nan_timestamp",
        "a.csv",
        "i,u,5,1\ni,u,5,nan\n",
        r"{in}/a.csv:2: non-finite timestamp 'nan'",
        fmt="amazon",
    ),
    data_case(
        "non_numeric_timestamp",
        "ratings.dat",
        "1::2::5::9\n1::3::5::soon\n",
        r"{in}/ratings.dat:2: non-numeric timestamp 'soon'",
    ),
    data_case(
        "broken_json",
        "d.json",
        '{"0": [1, 2],\n "1": [3,, 4]}',
        r"{in}/d.json:2: broken JSON",
        fmt="json",
    ),
    data_case(
        "broken_json_line",
        "a.json",
        '{"reviewerID": "u", "asin": "i", "unixReviewTime": 1}\n{"reviewerID": "u"',
        r"{in}/a.json:2: broken JSON",
        fmt="amazon",
    ),
    data_case(
        "json_not_an_object", "d.json", "[1, 2]", r"{in}/d.json: expected a JSON object", fmt="json"
    ),
    data_case(
        "json_missing_field",
        "a.json",
        '{"reviewerID": "u", "unixReviewTime": 1}\n',
        r"{in}/a.json:1: missing key\(s\) \['asin'\]",
        fmt="amazon",
    ),
    data_case(
        "recbole_bad_header",
        "r.inter",
        "user\titem\n1\t2\n",
        r"{in}/r.inter:1: expected a RecBole header",
        fmt="recbole",
    ),
    data_case(
        "recbole_wrong_field_count",
        "r.inter",
        RB_HEADER + "1\t2\t3\n1\t4\n",
        r"{in}/r.inter:3: expected 3 tab-separated fields, got 2",
    ),
    data_case(
        "duplicate_user_line",
        "s.txt",
        "1 2 3\n1 4\n",
        r"{in}/s.txt:2: user 1 already listed on line 1",
    ),
    data_case(
        "binary_garbage",
        "s.txt",
        b"\xff\xfe\x00\x81garbage\n",
        r"{in}/s.txt: cannot read file",
        fmt="s3rec",
    ),
    data_case(
        "broken_gzip",
        "r.json.gz",
        b"\x1f\x8b\x08\x00garbage",
        r"{in}/r.json.gz: cannot read file",
        fmt="amazon",
    ),
    Bad(
        "bad_data_file_through_the_cli",
        files(s_dot_txt="1 2 3\n2 x 4\n"),
        cli("--data.init_args.path={in}/s.txt", command="parse"),
        ValueError,
        r"{in}/s.txt:2: non-integer item id 'x'",
    ),
    # -- configuration: wrong keys and types, values out of range, NaN / inf
    Bad(
        "wrong_config_key",
        files(),
        cli("--data.init_args.no_such_option=1", command="parse"),
        CLIError,
        r"no_such_option",
    ),
    Bad(
        "wrong_config_type",
        files(),
        cli("--data.init_args.max_len=abc", command="parse"),
        CLIError,
        r'(?s)Parser key "max_len".*Got value: abc',
    ),
    Bad(
        "max_len_zero",
        files(),
        cli("--data.init_args.max_len=0", command="parse"),
        ValueError,
        r"SequenceDataModule: max_len must be an integer >= 1, got 0",
    ),
    Bad(
        "negative_batch_size",
        files(),
        cli("--data.init_args.batch_size=-3", command="parse"),
        ValueError,
        r"batch_size must be an integer >= 1, got -3",
    ),
    Bad(
        "nan_learning_rate",
        files(lr_dot_yaml="model:\n  init_args:\n    lr: .nan\n"),
        cli("--config", "{in}/lr.yaml", command="parse"),
        ValueError,
        r"lr must be finite, got nan",
    ),
    Bad(
        "inf_temperature",
        files(t_dot_yaml="model:\n  init_args:\n    temperature: .inf\n"),
        cli("--config", "{in}/t.yaml", command="parse"),
        ValueError,
        r"temperature must be finite, got inf",
    ),
    Bad(
        "unknown_loss",
        files(),
        cli("--model.init_args.loss=hinge", command="parse"),
        ValueError,
        r"loss must be one of \('ce', 'bce', 'sampled_softmax', 'ce_chunked', "
        r"'sampled_softmax_logq'\), got 'hinge'",
    ),
    Bad(
        "unknown_backbone",
        files(),
        cli("--model.init_args.backbone=NoSuchNet", command="parse"),
        CLIError,
        r'(?s)Parser key "backbone".*NoSuchNet',
    ),
    Bad(
        "broken_yaml",
        files(b_dot_yaml="trainer:\n  max_epochs: [1\n"),
        cli("--config", "{in}/b.yaml", command="parse"),
        CLIError,
        r"(?s)Problems parsing config.*line 2",
    ),
    Bad(
        "missing_config_file",
        files(),
        cli("--config", "{in}/nope.yaml", command="parse"),
        CLIError,
        r"nope.yaml",
    ),
    # -- checkpoints: another model, other data, damaged, unsafe
    Bad(  # a checkpoint with a vocabulary maps the data into it (tests/tasks); one without cannot
        "checkpoint_num_items_mismatch",
        ckpt_from(lambda c: c["bft_lightning"].pop("vocabulary")),
        cli_run("--data.init_args.synthetic_items=300", "--ckpt_path={in}/model.ckpt"),
        CLIError,
        r"{in}/model.ckpt: the checkpoint was trained on num_items=\d+ items but the data has \d+",
    ),
    Bad(
        "checkpoint_from_another_backbone",
        ckpt_from(),
        cli_run("--ckpt_path={in}/model.ckpt", config=EXPERIMENTS / "hstu_on_synthetic.yaml"),
        CLIError,
        r"--model.backbone.class_path: 'bft_lightning.models.HSTU' given, but the checkpoint "
        r"{in}/model.ckpt was trained with 'bft_lightning.models.sasrec.SASRec'",
    ),
    Bad(
        "checkpoint_with_other_options",
        ckpt_from(),
        cli_run("--model.init_args.backbone.init_args.d_model=24", "--ckpt_path={in}/model.ckpt"),
        CLIError,
        r"--model.backbone.d_model: 24 given, but the checkpoint {in}/model.ckpt was trained "
        r"with 16; this option cannot change without invalidating its weights",
    ),
    Bad(
        "checkpoint_from_a_language_model",
        ckpt_from(language_model_state),
        cli_run("--ckpt_path={in}/model.ckpt"),
        CLIError,
        r"{in}/model.ckpt: checkpoint from another model: saved from "
        r"bft_lightning.lm.task.LanguageSFT, the config builds "
        r"bft_lightning.tasks.SequentialRecommendation",
    ),
    Bad(
        "checkpoint_of_unknown_origin",
        ckpt_from(foreign_state),
        cli_run("--ckpt_path={in}/model.ckpt"),
        CLIError,
        r"{in}/model.ckpt: checkpoint from another model: missing parameters \['model\.",
    ),
    Bad(
        "checkpoint_half_written",
        truncated,
        cli_run("--ckpt_path={in}/model.ckpt"),
        CLIError,
        r"{in}/model.ckpt: not a complete PyTorch checkpoint",
    ),
    Bad(
        "checkpoint_empty",
        ckpt_from(raw=b""),
        cli_run("--ckpt_path={in}/model.ckpt"),
        CLIError,
        r"{in}/model.ckpt: empty file",
    ),
    Bad(
        "checkpoint_not_a_checkpoint",
        ckpt_from(raw=b"epoch: 3\nweights: fine\n"),
        cli_run("--ckpt_path={in}/model.ckpt"),
        CLIError,
        r"{in}/model.ckpt: not a complete PyTorch checkpoint",
    ),
    Bad(
        "checkpoint_with_pickled_code",
        unsafe,
        cli_run("--ckpt_path={in}/model.ckpt"),
        CLIError,
        r"{in}/model.ckpt: refused to load.*(?i:unsupported global)",
    ),
    Bad(
        "checkpoint_with_nan_weights",
        ckpt_from(nan_weights),
        cli_run("--ckpt_path={in}/model.ckpt"),
        CLIError,
        r"{in}/model.ckpt: parameter model.item_emb.weight holds NaN or inf values",
    ),
    Bad(
        "checkpoint_missing",
        files(),
        cli_run("--ckpt_path={in}/gone.ckpt"),
        CLIError,
        r"checkpoint not found: {in}/gone.ckpt",
    ),
    # -- language-model checkpoints (bft_lightning.lm.llama_format)
    Bad(
        "lm_checkpoint_without_weights",
        lm_config_only,
        lambda inp, out: read_state_dict(inp / "lm"),
        CheckpointError,
        r"'{in}/lm' has no weights .*found: config.json",
    ),
    Bad(
        "lm_checkpoint_missing_shard",
        lm_missing_shard,
        lambda inp, out: read_state_dict(inp / "lm"),
        CheckpointError,
        r"'{in}/lm': model.safetensors.index.json lists shards that are missing: "
        r"\['model-00002-of-00002.safetensors'\]",
    ),
    Bad(
        "lm_checkpoint_without_tokenizer",
        lm_config_only,
        lambda inp, out: load_tokenizer(inp / "lm"),
        CheckpointError,
        r"'{in}/lm' has no tokenizer.json; found: config.json",
    ),
    Bad(
        "lm_tokenizer_mismatch",
        lm_tokenizer_40,
        lm_tokenizer_mismatch,
        ValueError,
        r"tokenizer has 40 ids but the model's vocab_size is 16",
    ),
]


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A SASRec checkpoint of the tiny synthetic set-up (2 training steps)."""
    out = tmp_path_factory.mktemp("trained")
    L.seed_everything(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = main(
            [
                "fit",
                "--config",
                str(SASREC),
                *TINY,
                f"--trainer.default_root_dir={out}",
                "--trainer.max_steps=2",
                "--trainer.limit_val_batches=0",
                "--trainer.callbacks=[]",
            ]
        )
    path = out / "model.ckpt"
    result.trainer.save_checkpoint(path)
    return path


def test_the_table_is_large_enough():
    assert len(BAD) >= 30 and len({b.name for b in BAD}) == len(BAD)


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.name)
def test_bad_input_is_refused_clearly_and_nothing_is_written_or_lost(bad, tmp_path, trained):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    bad.setup(inp, trained)
    before = snapshot(inp)
    with pytest.raises(bad.error) as info:
        bad.run(inp, out)
    pattern = bad.message.replace("{in}", re.escape(str(inp)))
    assert re.search(pattern, str(info.value)), f"{info.value}\n!~ {pattern}"
    assert snapshot(inp) == before  # nothing lost or changed
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]  # nothing written


def test_lightning_load_path_checks_the_checkpoint_too(tmp_path, trained):
    """``Trainer.test(ckpt_path=...)`` without the CLI runs the same checks (on_load_checkpoint)."""
    from functools import partial

    from bft_lightning.models import SASRec
    from bft_lightning.tasks import SequentialRecommendation

    dm = SequenceDataModule(max_len=12, synthetic_users=300, synthetic_items=300)
    model = SequentialRecommendation(dm.num_items, 12, backbone=partial(SASRec, d_model=16))
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    with pytest.raises(ValueError, match=re.escape(str(trained)) + ": the checkpoint was trained"):
        trainer.test(model, dm, ckpt_path=str(trained))
    bare = SequentialRecommendation(dm.num_items, 12, backbone=partial(SASRec, d_model=16))
    with pytest.raises(ValueError, match=r"model scores num_items=7 items but the data has \d+"):
        bare.num_items = 7
        trainer.test(bare, dm)


def test_checkpoint_load_error_is_a_value_error():
    assert issubclass(CheckpointLoadError, ValueError)


# ----------------------------------------------------------------------------- valid after all
def test_duplicate_timestamps_keep_file_order_and_lose_nothing(tmp_path):
    text = "1::30::5::100\n1::10::5::50\n1::20::5::100\n1::40::5::100\n2::10::5::7\n2::20::5::8\n"
    data = SequenceDataModule(path=str(put(tmp_path, "ratings.dat", text)), max_len=8).sequences
    items = [data.item_ids[i] for i in data.items[data.offsets[0] : data.offsets[1]]]
    assert items == ["10", "30", "20", "40"]  # by time; the ties at t=100 keep file order
    assert len(data.items) == 6


def test_huge_ids_are_tokens_and_are_remapped(tmp_path):
    big = 10**30
    path = put(tmp_path, "s.txt", f"{big} {big + 1} 5 {big + 1} 7\n2 5 7 9\n")
    data = SequenceDataModule(path=str(path), max_len=8).sequences
    assert data.user_ids.tolist() == [str(big), "2"]
    assert data.item_ids.tolist() == ["", str(big + 1), "5", "7", "9"]
    assert data.items.tolist() == [1, 2, 1, 3, 2, 3, 4] and data.num_items == 4


def test_damaged_cache_is_ignored_and_rebuilt(tmp_path):
    src = put(tmp_path, "s.txt", "1 5 3 5 9\n2 7 8 9 3\n3 3 7 8\n")
    cache = tmp_path / "cache"
    first = SequenceDataModule(path=str(src), max_len=8, cache_dir=str(cache))
    first.prepare_data()
    (entry,) = cache.iterdir()
    items = entry / "items.npy"
    items.write_bytes(items.read_bytes()[:100])  # a half-written cache (never by our writer)
    with pytest.warns(UserWarning, match="ignoring unreadable cache"):
        again = SequenceDataModule(path=str(src), max_len=8, cache_dir=str(cache)).sequences
    assert again.items.tolist() == first.sequences.items.tolist()
    assert [p.name for p in cache.iterdir()] == [entry.name]  # rebuilt in place
