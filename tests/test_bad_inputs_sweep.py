"""The second bad-input sweep: never lose a file, never score the wrong model.

Each row of ``CASES`` prepares an input folder (``in/``: the tiny trained
checkpoint, histories in JSON lines and CSV, a config, an earlier output),
runs one command line in this process through ``bft_lightning.cli.entry``
and checks that

- it exits with status 2 and prints exactly one ``error:`` line, which matches
  the row's pattern (the file, line or option it is about), and no traceback;
- every file under ``in/`` (inputs, the checkpoint, the earlier output) is
  byte-for-byte unchanged, and ``out/`` (the run's folder) holds no file.

The classes: outputs that would destroy a file; checkpoints whose digest
record is damaged (fail closed); checkpoints against data they were not
trained on; options the user stated against the checkpoint's; untrained
weights; Lightning's configuration errors; data files; config files; devices.
``API`` rows do the same through the Python API (a ``ValueError`` naming the
argument). The tests after the tables check what must keep working: the
user's evaluation options win over the checkpoint's (``test``, ``validate``,
``predict``, ``fit``), a partial test does not replace ``metrics.md``, and
``--debug`` shows the traceback of every command.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch

from bft_lightning.cli import entry, main

pytestmark = pytest.mark.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[1]
SASREC = REPO / "configs" / "experiments" / "sasrec_on_synthetic.yaml"
TINY = [
    "--data.init_args.synthetic_users=300",
    "--data.init_args.max_len=12",
    "--model.init_args.backbone.init_args.d_model=16",
    "--model.init_args.backbone.init_args.dim_feedforward=32",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.logger=false",
]
WRITER = "bft_lightning.serving.RecommendationWriter"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The tiny SASRec after 2 epochs of 1 batch, sealed by the configs' AtomicCheckpointIO."""
    out = tmp_path_factory.mktemp("sweep_trained")
    L.seed_everything(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = main(["fit", "--config", str(SASREC), *TINY, f"--trainer.default_root_dir={out}",
                    "--trainer.max_epochs=2", "--trainer.limit_train_batches=1",
                    "--trainer.limit_val_batches=0", "--trainer.callbacks=[]"])  # fmt: skip
    path = out / "model.ckpt"
    cli.trainer.save_checkpoint(path)
    return path


def item_ids(ckpt: Path) -> list[str]:
    vocabulary = torch.load(ckpt, weights_only=True)["bft_lightning"]["vocabulary"]
    return [str(i) for i in vocabulary["item_ids"][1:]]


def standard_inputs(inp: Path, ckpt: Path) -> None:
    """in/: model.ckpt, hist.jsonl, hist.csv, config.yaml, earlier.csv, earlier.ckpt."""
    shutil.copy(ckpt, inp / "model.ckpt")
    items = item_ids(ckpt)[:6]
    (inp / "hist.jsonl").write_text(
        "".join(json.dumps({"user": f"u{u}", "items": items[u : u + 3]}) + "\n" for u in range(3))
    )
    (inp / "hist.csv").write_text(
        "user,item\n" + "".join(f"u{u},{items[u + j]}\n" for u in range(3) for j in range(3))
    )
    (inp / "config.yaml").write_text("trainer:\n  max_epochs: 1\n")
    (inp / "earlier.csv").write_text("user,rank,item,score,confidence\nu0,1,5,0.5,0.1\n")
    shutil.copy(ckpt, inp / "earlier.ckpt")


Setup = Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    name: str
    argv: list[str]  # "{in}", "{out}" are replaced
    message: str  # regex; "{in}" is the input folder (escaped)
    setup: Setup | None = None


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def cli(sub: str, *args: str) -> list[str]:
    """A LightningCLI subcommand of the tiny set-up writing into out/."""
    return [sub, "--config", str(SASREC), *TINY, "--trainer.default_root_dir={out}", *args]


def rec(*args: str, output: str = "{out}/recs.csv") -> list[str]:
    return ["recommend", "--ckpt_path", "{in}/model.ckpt", "--input", "{in}/hist.jsonl",
            "--output", output, "--no-progress", *args]  # fmt: skip


def cal(*args: str) -> list[str]:
    return ["calibrate", "--ckpt_path", "{in}/model.ckpt", "--input", "{in}/hist.jsonl",
            "--k", "2", *args]  # fmt: skip


# ---------------------------------------------------------------- setups
def write(name: str, content: str | bytes) -> Setup:
    def setup(inp: Path) -> None:
        path = inp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")

    return setup


def symlink(name: str, target: str) -> Setup:
    return lambda inp: (inp / name).symlink_to(inp / target)


def hardlink(name: str, target: str) -> Setup:
    return lambda inp: os.link(inp / target, inp / name)


def folder(name: str, mode: int | None = None) -> Setup:
    def setup(inp: Path) -> None:
        (inp / name).mkdir()
        if mode is not None:
            os.chmod(inp / name, mode)

    return setup


def read_only(name: str) -> Setup:
    return lambda inp: os.chmod(inp / name, 0o444)


def _patch(inp: Path, change: Callable[[bytearray], None]) -> None:
    path = inp / "model.ckpt"
    data = bytearray(path.read_bytes())
    change(data)
    path.write_bytes(bytes(data))


def digest_crc_broken(inp: Path) -> None:
    """One byte of the digest record changed in place: its zip CRC fails."""

    def change(data: bytearray) -> None:
        at = data.find(b"bft_lightning.sha256", 0)  # the local header's name
        start = at + len("bft_lightning.sha256")
        data[start + 5] ^= 0x01  # a digest character (no extra field in our writer)

    _patch(inp, change)


def digest_missing(inp: Path) -> None:
    """The digest record renamed away (as if a tool had dropped it)."""
    _patch(inp, lambda d: d.__setitem__(slice(None), d.replace(b".sha256", b".sha257")))


def digest_garbage(inp: Path) -> None:
    def change(data: bytearray) -> None:
        start = data.find(b"bft_lightning.sha256") + len("bft_lightning.sha256")
        data[start : start + 64] = b"z" * 64

    _patch(inp, change)


def weight_flipped(inp: Path) -> None:
    path = inp / "model.ckpt"
    weight = torch.load(path, weights_only=True)["state_dict"]["model.item_emb.weight"]

    def change(data: bytearray) -> None:
        at = data.find(weight.numpy().tobytes()[:64])
        data[at + 4 * 20 + 1] ^= 0x04

    _patch(inp, change)


def ckpt_dir(inp: Path) -> None:
    (inp / "model.ckpt").unlink()
    (inp / "model.ckpt").mkdir()


def foreign_ids(inp: Path) -> None:
    """Histories whose ids the checkpoint has never seen."""
    (inp / "unknown.jsonl").write_text(
        "".join(
            json.dumps({"user": f"u{u}", "items": [f"x{u}", f"y{u}", "z"]}) + "\n" for u in range(5)
        )  # fmt: skip
    )


def s3rec_file(ids_from: int) -> Setup:
    """A small s3rec-format data file (user item item ...)."""
    rows = "".join(
        f"{u} " + " ".join(str(ids_from + (u * 3 + j) % 40) for j in range(6)) + "\n"
        for u in range(1, 61)
    )
    return write("other.txt", rows)


ML = "".join(f"{u}::{i}::5::{100 + i}\n" for u in range(1, 6) for i in range(1, 6))
CSV = "user_id,item_id,timestamp\n" + "".join(
    f"{u},{i},{100 + i}\n" for u in range(1, 6) for i in range(1, 6)
)
INTER = "user_id:token\titem_id:token\ttimestamp:float\n" + "".join(
    f"{u}\t{i}\t{i}\n" for u in range(1, 6) for i in range(1, 6)
)


def data(name: str) -> list[str]:
    return cli("fit", f"--data.init_args.path={{in}}/{name}", "--trainer.max_steps=1")


def yaml(name: str) -> list[str]:
    return cli("fit", "--config", f"{{in}}/{name}", "--trainer.max_steps=1")


# ---------------------------------------------------------------- the table
CASES = [
    # -- outputs: recommend
    Case("rec_output_is_its_input", rec(output="{in}/hist.jsonl"),
         r"--output {in}/hist.jsonl: is one of the command's inputs"),
    Case("rec_output_is_its_input_overwrite", rec("--overwrite", output="{in}/hist.jsonl"),
         r"is one of the command's inputs"),
    Case("rec_output_is_the_csv_input",
         ["recommend", "--ckpt_path", "{in}/model.ckpt", "--input", "{in}/hist.csv",
          "--output", "{in}/hist.csv", "--overwrite"], r"{in}/hist.csv: is one of"),
    Case("rec_output_input_by_another_path", rec(output="{in}/../in/./hist.jsonl"),
         r"is one of the command's inputs \({in}/hist.jsonl\)"),
    Case("rec_output_symlink_to_input", rec("--overwrite", output="{in}/link.jsonl"),
         r"--output {in}/link.jsonl: is one of the command's inputs", symlink("link.jsonl",
                                                                              "hist.jsonl")),
    Case("rec_output_hardlink_to_input", rec("--overwrite", output="{in}/hard.jsonl"),
         r"--output {in}/hard.jsonl: is one of", hardlink("hard.jsonl", "hist.jsonl")),
    Case("rec_output_symlink_to_checkpoint", rec("--overwrite", output="{in}/ck.csv"),
         r"is one of the command's inputs \({in}/model.ckpt\)", symlink("ck.csv", "model.ckpt")),
    Case("rec_output_hardlink_to_checkpoint", rec("--overwrite", output="{in}/ck.csv"),
         r"is one of the command's inputs", hardlink("ck.csv", "model.ckpt")),
    Case("rec_output_exists", rec(output="{in}/earlier.csv"),
         r"--output {in}/earlier.csv: the file exists; pass --overwrite"),
    Case("rec_output_is_a_directory", rec("--overwrite", output="{in}/d.csv"),
         r"--output {in}/d.csv: is a directory", folder("d.csv")),
    Case("rec_output_parent_missing", rec(output="{in}/no/such/recs.csv"),
         r"--output {in}/no/such/recs.csv: the folder {in}/no/such does not exist"),
    Case("rec_output_parent_read_only", rec(output="{in}/ro/recs.csv"),
         r"--output {in}/ro/recs.csv: the folder {in}/ro is read-only", folder("ro", 0o555)),
    Case("rec_output_file_read_only", rec("--overwrite", output="{in}/earlier.csv"),
         r"--output {in}/earlier.csv: the file exists and is read-only",
         read_only("earlier.csv")),
    Case("rec_output_parent_is_a_file", rec(output="{in}/hist.jsonl/recs.csv"),
         r"--output {in}/hist.jsonl/recs.csv: "),
    # -- outputs: calibrate
    Case("cal_output_is_the_checkpoint", cal("--output", "{in}/model.ckpt"),
         r"--output {in}/model.ckpt: is one of the command's inputs"),
    Case("cal_output_is_the_checkpoint_overwrite",
         cal("--output", "{in}/model.ckpt", "--overwrite"), r"is one of the command's inputs"),
    Case("cal_output_is_its_input", cal("--output", "{in}/hist.jsonl", "--overwrite"),
         r"--output {in}/hist.jsonl: is one of the command's inputs"),
    Case("cal_output_is_the_config",
         ["calibrate", "--ckpt_path", "{in}/model.ckpt", "--config", "{in}/config.yaml",
          "--output", "{in}/config.yaml", "--overwrite"], r"--output {in}/config.yaml: is one of"),
    Case("cal_output_exists", cal("--output", "{in}/earlier.ckpt"),
         r"--output {in}/earlier.ckpt: the file exists; pass --overwrite"),
    Case("cal_output_is_a_directory", cal("--output", "{in}/d", "--overwrite"),
         r"--output {in}/d: is a directory", folder("d")),
    Case("cal_output_parent_missing", cal("--output", "{in}/none/c.ckpt"),
         r"the folder {in}/none does not exist"),
    Case("cal_output_hardlink_to_checkpoint", cal("--output", "{in}/h.ckpt", "--overwrite"),
         r"--output {in}/h.ckpt: is one of", hardlink("h.ckpt", "model.ckpt")),
    # -- outputs: predict's writer
    Case("predict_output_is_the_checkpoint",
         cli("predict", "--ckpt_path={in}/model.ckpt", f"--trainer.callbacks+={WRITER}",
             "--trainer.callbacks.output={in}/model.ckpt"),
         r"--trainer.callbacks.output {in}/model.ckpt: is one of the command's inputs"),
    Case("predict_output_is_the_config",
         cli("predict", "--config={in}/config.yaml", "--ckpt_path={in}/model.ckpt",
             f"--trainer.callbacks+={WRITER}", "--trainer.callbacks.output={in}/config.yaml",
             "--overwrite"), r"{in}/config.yaml: is one of the command's inputs"),
    Case("predict_output_exists",
         cli("predict", "--ckpt_path={in}/model.ckpt", f"--trainer.callbacks+={WRITER}",
             "--trainer.callbacks.output={in}/earlier.csv"),
         r"{in}/earlier.csv: the file exists; pass --overwrite"),
    Case("predict_output_is_a_directory",
         cli("predict", "--ckpt_path={in}/model.ckpt", f"--trainer.callbacks+={WRITER}",
             "--trainer.callbacks.output={in}/d.csv"), r"{in}/d.csv: is a directory",
         folder("d.csv")),
    Case("predict_output_parent_missing",
         cli("predict", "--ckpt_path={in}/model.ckpt", f"--trainer.callbacks+={WRITER}",
             "--trainer.callbacks.output={in}/x/y.csv"), r"the folder {in}/x does not exist"),
    # -- integrity: the digest fails closed
    Case("digest_crc_broken_test", cli("test", "--ckpt_path={in}/model.ckpt"),
         r"{in}/model.ckpt: its content digest record is damaged", digest_crc_broken),
    Case("digest_crc_broken_recommend", rec(),
         r"{in}/model.ckpt: its content digest record is damaged", digest_crc_broken),
    Case("digest_crc_broken_calibrate", cal(),
         r"{in}/model.ckpt: its content digest record is damaged", digest_crc_broken),
    Case("digest_missing_test", cli("test", "--ckpt_path={in}/model.ckpt"),
         r"{in}/model.ckpt: written with a content digest, but the digest record is missing",
         digest_missing),
    Case("digest_missing_recommend", rec(), r"{in}/model.ckpt: .*digest record is missing",
         digest_missing),
    Case("digest_missing_fit", cli("fit", "--ckpt_path={in}/model.ckpt"),
         r"{in}/model.ckpt: .*digest record is missing", digest_missing),
    Case("digest_garbage_validate", cli("validate", "--ckpt_path={in}/model.ckpt"),
         r"{in}/model.ckpt: its content digest record is damaged", digest_garbage),
    Case("digest_garbage_predict", cli("predict", "--ckpt_path={in}/model.ckpt"),
         r"{in}/model.ckpt: its content digest record is damaged", digest_garbage),
    Case("weight_flipped_recommend", rec(), r"{in}/model.ckpt: content digest mismatch",
         weight_flipped),
    Case("weight_flipped_calibrate", cal(), r"{in}/model.ckpt: content digest mismatch",
         weight_flipped),
    Case("checkpoint_is_a_directory", cli("test", "--ckpt_path={in}/model.ckpt"),
         r"{in}/model.ckpt: is a directory", ckpt_dir),
    Case("checkpoint_is_a_directory_recommend", rec(), r"{in}/model.ckpt: is a directory",
         ckpt_dir),
    # -- checkpoints against data
    Case("other_data_test", cli("test", "--ckpt_path={in}/model.ckpt",
                                "--data.init_args.synthetic_items=60",
                                "--data.init_args.synthetic_clusters=5"),
         r"{in}/model.ckpt: trained on synthetic data .*num_items=500.*, but the data is "
         r"dataset 'synthetic', which overlaps it little: .*--allow_other_data"),
    Case("other_data_validate", cli("validate", "--ckpt_path={in}/model.ckpt",
                                    "--data.init_args.synthetic_items=60",
                                "--data.init_args.synthetic_clusters=5"),
         r"{in}/model.ckpt: trained on synthetic data.*overlaps it little"),
    Case("other_data_predict", cli("predict", "--ckpt_path={in}/model.ckpt",
                                   "--data.init_args.synthetic_items=60",
                                "--data.init_args.synthetic_clusters=5"),
         r"{in}/model.ckpt: .*overlaps it little"),
    Case("other_data_fit", cli("fit", "--ckpt_path={in}/model.ckpt",
                               "--data.init_args.synthetic_items=60",
                                "--data.init_args.synthetic_clusters=5"),
         r"{in}/model.ckpt: .*overlaps it little"),
    Case("other_format_test", cli("test", "--ckpt_path={in}/model.ckpt",
                                  "--data.init_args.path={in}/other.txt"),
         r"{in}/model.ckpt: trained on synthetic data .*\(format synthetic\), but the data is "
         r"{in}/other.txt \(format s3rec\): another reader format", s3rec_file(1)),
    Case("no_id_known_test", cli("test", "--ckpt_path={in}/model.ckpt",
                                 "--data.init_args.path={in}/other.txt", "--allow_other_data"),
         r"{in}/model.ckpt: the data's item ids do not match the checkpoint's: none of the item "
         r"ids of {in}/other.txt", s3rec_file(10**6)),
    Case("other_data_calibrate_config",
         ["calibrate", "--ckpt_path", "{in}/model.ckpt", "--config", str(SASREC), *TINY[:2],
          "--data.init_args.synthetic_items=60", "--data.init_args.synthetic_clusters=5"],
         r"{in}/model.ckpt: .*overlaps it little"),
    Case("unknown_ids_calibrate_input",
         ["calibrate", "--ckpt_path", "{in}/model.ckpt", "--input", "{in}/unknown.jsonl"],
         r"{in}/unknown.jsonl: the data's item ids do not match the checkpoint's: none of",
         foreign_ids),
    # -- options stated against the checkpoint's
    Case("explicit_d_model", cli("test", "--ckpt_path={in}/model.ckpt",
                                 "--model.init_args.backbone.init_args.d_model=32"),
         r"--model.backbone.d_model: 32 given, but the checkpoint {in}/model.ckpt was trained "
         r"with 16; this option cannot change without invalidating its weights"),
    Case("explicit_nhead", cli("validate", "--ckpt_path={in}/model.ckpt",
                               "--model.init_args.backbone.init_args.nhead=4"),
         r"--model.backbone.nhead: 4 given, but the checkpoint .* was trained with 2"),
    Case("explicit_num_layers", cli("test", "--ckpt_path={in}/model.ckpt",
                                    "--model.init_args.backbone.init_args.num_layers=1"),
         r"--model.backbone.num_layers: 1 given, .* trained with 2"),
    Case("explicit_ffn", cli("predict", "--ckpt_path={in}/model.ckpt",
                             "--model.init_args.backbone.init_args.dim_feedforward=64"),
         r"--model.backbone.dim_feedforward: 64 given, .* trained with 32"),
    Case("explicit_precision", cli("fit", "--ckpt_path={in}/model.ckpt",
                                   "--model.init_args.backbone.init_args.precision=off"),
         r"--model.backbone.precision: 'off' given, .* trained with 'on'"),
    Case("explicit_in_config_file", cli("test", "--config={in}/big.yaml",
                                        "--ckpt_path={in}/model.ckpt"),
         r"--model.backbone.d_model: 64 given, .* trained with 16",
         write("big.yaml", "model:\n  init_args:\n    backbone:\n      init_args:\n"
                           "        d_model: 64\n")),
    # -- untrained weights
    Case("untrained_test", cli("test"), r"test without --ckpt_path would run on untrained .*"
                                        r"--allow_untrained"),
    Case("untrained_validate", cli("validate"), r"validate without --ckpt_path .*untrained"),
    Case("untrained_predict", cli("predict"), r"predict without --ckpt_path .*untrained"),
    # -- Lightning's configuration errors
    Case("devices_0", cli("fit", "--trainer.devices=0"), r"--trainer.devices=0: "),
    Case("devices_negative", cli("fit", "--trainer.devices=-3"), r"--trainer.devices=-3: "),
    Case("max_epochs_negative", cli("fit", "--trainer.max_epochs=-5"),
         r"--trainer.max_epochs=-5: `max_epochs` must be a non-negative integer"),
    Case("max_steps_negative", cli("fit", "--trainer.max_steps=-7"), r"--trainer.max_steps=-7"),
    Case("accelerator_gpu", cli("fit", "--trainer.accelerator=gpu"),
         r"--trainer.accelerator=gpu: "),
    Case("accelerator_cuda", cli("fit", "--trainer.accelerator=cuda"),
         r"--trainer.accelerator=cuda: "),
    Case("limit_train_negative", cli("fit", "--trainer.limit_train_batches=-1"),
         r"--trainer.limit_train_batches=-1: "),
    Case("val_check_interval_0", cli("fit", "--trainer.val_check_interval=0"),
         r"--trainer.val_check_interval=0: must be > 0"),
    Case("check_val_every_0", cli("fit", "--trainer.check_val_every_n_epoch=0"),
         r"--trainer.check_val_every_n_epoch=0: must be an integer >= 1"),
    Case("accumulate_0", cli("fit", "--trainer.accumulate_grad_batches=0"),
         r"--trainer.accumulate_grad_batches=0: must be an integer >= 1"),
    Case("log_every_0", cli("fit", "--trainer.log_every_n_steps=0"),
         r"--trainer.log_every_n_steps=0: must be an integer >= 1"),
    Case("restored_epoch_beyond_max", cli("fit", "--ckpt_path={in}/model.ckpt",
                                          "--trainer.max_epochs=1"),
         r"--trainer.max_epochs=1: the checkpoint {in}/model.ckpt was saved at epoch 2"),
    Case("device_cuda_recommend", rec("--device", "cuda"),
         r"--device: cuda asked for, but CUDA is not available"),
    Case("device_cuda_calibrate", cal("--device", "cuda"),
         r"--device: cuda asked for, but CUDA is not available"),
    Case("device_nonsense_recommend", rec("--device", "gpu0"),
         r"--device: 'gpu0' is not a device name"),
    # -- data files
    Case("data_bytes_movielens", data("ratings.dat"), r"{in}/ratings.dat:26: .*not UTF-8",
         write("ratings.dat", ML.encode() + b"6::\xff\xfe::5::100\n")),
    Case("data_bytes_csv", data("x.csv"), r"{in}/x.csv:27: .*not UTF-8",
         write("x.csv", CSV.encode() + b"7,\xff,3\n")),
    Case("data_iso_date_movielens", data("ratings.dat"),
         r"{in}/ratings.dat:26: timestamp '2020-01-02T00:00:00' is a date; .*unix seconds",
         write("ratings.dat", ML + "6::3::5::2020-01-02T00:00:00\n")),
    Case("data_iso_date_csv", data("x.csv"), r"{in}/x.csv:2: timestamp '2020-01-01' is a date",
         write("x.csv", CSV.replace(",101\n", ",2020-01-01\n"))),
    Case("data_iso_date_recbole", data("x.inter"), r"{in}/x.inter:2: timestamp .* is a date",
         write("x.inter", INTER.replace("\t1\n", "\t2021-03-04\n", 1))),
    Case("data_header_repeated_csv", data("x.csv"),
         r"{in}/x.csv:27: .*a header line repeated in the middle of the file",
         write("x.csv", CSV + "user_id,item_id,timestamp\n7,1,5\n")),
    Case("data_header_repeated_recbole", data("x.inter"),
         r"{in}/x.inter:27: .*a header line repeated",
         write("x.inter", INTER + "user_id:token\titem_id:token\ttimestamp:float\n")),
    Case("data_unrecognised_header", data("x.csv"),
         r"{in}/x.csv:1: unrecognised header \['customer', 'product', 'when'\]: expected a column "
         r"for each of \(user: user, user_id",
         write("x.csv", "customer,product,when\n" + CSV.split("\n", 1)[1])),
    Case("data_is_a_directory", data("folder"), r"{in}/folder: is a directory",
         folder("folder")),
    Case("rec_input_is_a_directory", ["recommend", "--ckpt_path", "{in}/model.ckpt", "--input",
                                      "{in}/d.jsonl", "--output", "{out}/r.csv"],
         r"{in}/d.jsonl: is a directory", folder("d.jsonl")),
    Case("rec_input_bytes", ["recommend", "--ckpt_path", "{in}/model.ckpt", "--input",
                             "{in}/b.csv", "--output", "{out}/r.csv"],
         r"{in}/b.csv:2: not UTF-8", write("b.csv", b"u1,1\n\xff,2\n")),
    Case("rec_jsonl_user_repeated", ["recommend", "--ckpt_path", "{in}/model.ckpt", "--input",
                                     "{in}/rep.jsonl", "--output", "{out}/r.csv"],
         r"{in}/rep.jsonl:3: user 'a' already has a history on line 1",
         write("rep.jsonl", '{"user": "a", "items": []}\n{"user": "b", "items": []}\n'
                            '{"user": "a", "items": []}\n')),
    Case("rec_csv_user_repeated", ["recommend", "--ckpt_path", "{in}/model.ckpt", "--input",
                                   "{in}/rep.csv", "--output", "{out}/r.csv"],
         r"{in}/rep.csv:3: user 'a' already had rows", write("rep.csv", "a,1\nb,2\na,3\n")),
    # -- config files
    Case("config_empty", yaml("e.yaml"), r"{in}/e.yaml: empty config", write("e.yaml", "")),
    Case("config_only_comments", yaml("c.yaml"), r"{in}/c.yaml: empty config",
         write("c.yaml", "# a comment\n\n# another\n")),
    Case("config_a_list", yaml("l.yaml"), r"{in}/l.yaml: expected a mapping of options .*list",
         write("l.yaml", "- trainer\n- model\n")),
    Case("config_a_scalar", yaml("s.yaml"), r"{in}/s.yaml: expected a mapping of options .*int",
         write("s.yaml", "3\n")),
    Case("config_include_missing", yaml("i.yaml"),
         r"{in}/i.yaml: includes ../nope/model.yaml, which is missing \(looked for "
         r"{in}/../nope/model.yaml\)", write("i.yaml", "model: ../nope/model.yaml\n")),
    Case("config_nested_include_missing", yaml("n.yaml"),
         r"{in}/n.yaml: includes bb.yaml, which is missing",
         write("n.yaml", "model:\n  init_args:\n    backbone: bb.yaml\n")),
    Case("config_include_of_include_missing", yaml("top.yaml"),
         r"{in}/mid.yaml: includes gone.yaml, which is missing \(looked for {in}/gone.yaml\)",
         lambda inp: (write("top.yaml", "data: mid.yaml\n")(inp),
                      write("mid.yaml", "init_args:\n  x: gone.yaml\n")(inp))),
    Case("config_duplicate_key", yaml("d.yaml"),
         r"{in}/d.yaml: key 'max_epochs' is given twice, on line 2 and line 3",
         write("d.yaml", "trainer:\n  max_epochs: 3\n  max_epochs: 5\n")),
    Case("config_duplicate_top_key", yaml("t.yaml"),
         r"{in}/t.yaml: key 'trainer' is given twice, on line 1 and line 3",
         write("t.yaml", "trainer:\n  max_epochs: 3\ntrainer:\n  max_steps: 5\n")),
    Case("config_is_a_directory", yaml("cfg"), r"{in}/cfg: is a directory", folder("cfg")),
    Case("config_bytes", yaml("b.yaml"), r"{in}/b.yaml: line 2: not UTF-8",
         write("b.yaml", b"trainer:\n  \xff: 1\n")),
    Case("config_missing", yaml("gone.yaml"), r"config file not found: {in}/gone.yaml"),
]  # fmt: skip


def test_the_sweep_is_large_enough():
    assert len(CASES) + len(API) >= 80 and len({c.name for c in CASES}) == len(CASES)


# rows that are bad input only on a machine without CUDA
NO_CUDA = {"accelerator_gpu", "accelerator_cuda", "device_cuda_recommend", "device_cuda_calibrate",
           "device_cuda"}  # fmt: skip


def run_entry(argv: list[str], capsys) -> tuple[int | str | None, str]:
    with pytest.raises(SystemExit) as stop, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entry(argv)
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_input_exits_2_with_one_line_and_loses_nothing(case, tmp_path, trained, capsys):
    if case.name in NO_CUDA and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    out.mkdir()
    standard_inputs(inp, trained)
    if case.setup is not None:
        case.setup(inp)
    before = snapshot(inp)
    argv = [a.replace("{in}", str(inp)).replace("{out}", str(out)) for a in case.argv]
    try:
        code, err = run_entry(argv, capsys)
    finally:
        for p in inp.rglob("*"):  # read-only set-ups: let tmp_path be cleaned up
            if p.is_dir() and not p.is_symlink():
                os.chmod(p, 0o755)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]), err[-2000:]
    pattern = case.message.replace("{in}", re.escape(str(inp)))
    assert re.search(pattern, lines[0]), f"{lines[0]}\n!~ {pattern}"
    assert snapshot(inp) == before  # no input, checkpoint or earlier output changed
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]
    assert not [p for p in inp.rglob(".tmp-*")]  # no temporary file left


# ---------------------------------------------------------------- the Python API
@dataclass(frozen=True)
class Api:
    name: str
    run: Callable[[Path], object]
    message: str


def _rec(path: Path, **kw: object):
    from bft_lightning.serving import Recommender

    return Recommender.from_checkpoint(path, **kw)  # type: ignore[arg-type]


def _recommend(**kw: object) -> Callable[[Path], object]:
    def run(ckpt: Path) -> object:
        rec = _rec(ckpt)
        return rec.recommend([item_ids(ckpt)[:2]], **kw)  # type: ignore[arg-type]

    return run


def _writer(**kw: object) -> Callable[[Path], object]:
    from bft_lightning.serving import RecommendationWriter

    return lambda ckpt: RecommendationWriter(**kw)  # type: ignore[arg-type]


def _other_data(ckpt: Path) -> object:
    from bft_lightning.datamodules import SequenceDataModule

    dm = SequenceDataModule(
        max_len=12, synthetic_users=300, synthetic_items=60, synthetic_clusters=5
    )
    return dm.use_vocabulary(torch.load(ckpt, weights_only=True)["bft_lightning"]["vocabulary"],
                             str(ckpt))  # fmt: skip


def _check_output(*args: object, **kw: object) -> Callable[[Path], object]:
    from bft_lightning.utils.outputs import check_output

    def run(ckpt: Path) -> object:
        inputs = [str(i).replace("CKPT", str(ckpt)) for i in kw.pop("inputs", [])]  # type: ignore[attr-defined]
        return check_output(str(args[0]).replace("CKPT", str(ckpt)), inputs, **kw)  # type: ignore[arg-type]

    return run


API = [
    Api("exclude_seen_string", _recommend(exclude_seen="no"),
        r"exclude_seen must be True or False, got 'no'"),
    Api("exclude_seen_int", _recommend(exclude_seen=1), r"exclude_seen must be True or False"),
    Api("k_float", _recommend(k=10.0), r"k must be an integer in 1\.\.\d+ .*got 10.0"),
    Api("k_string", _recommend(k="10"), r"k must be an integer .*got '10'"),
    Api("k_bool", _recommend(k=True), r"k must be an integer .*got True"),
    Api("batch_size_string", _recommend(batch_size="64"),
        r"batch_size must be an integer >= 1, got '64'"),
    Api("device_cuda", lambda ckpt: _rec(ckpt, device="cuda"),
        r"device: cuda asked for, but CUDA is not available"),
    Api("device_int", lambda ckpt: _rec(ckpt, device=3),
        r"device: expected a device name such as 'cpu' or 'cuda', got 3"),
    Api("writer_exclude_seen_string", _writer(exclude_seen="yes"),
        r"exclude_seen must be True or False, got 'yes'"),
    Api("writer_overwrite_string", _writer(overwrite="false"),
        r"overwrite must be True or False, got 'false'"),
    Api("datamodule_allow_other_data_string",
        lambda ckpt: __import__("bft_lightning.datamodules").datamodules.SequenceDataModule(
            allow_other_data="yes"), r"allow_other_data must be true or false, got 'yes'"),
    Api("datamodule_other_data", _other_data, r"overlaps it little"),
    Api("check_output_is_an_input", _check_output("CKPT", inputs=["CKPT"]),
        r"--output .*: is one of the command's inputs"),
    Api("check_output_named_option", _check_output("CKPT", what="--export.output"),
        r"--export.output .*: the file exists; pass --overwrite"),
]  # fmt: skip


@pytest.mark.parametrize("case", API, ids=lambda c: c.name)
def test_bad_api_argument_is_a_value_error_naming_it(case, trained, tmp_path):
    if case.name in NO_CUDA and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    ckpt = tmp_path / "model.ckpt"
    shutil.copy(trained, ckpt)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        case.run(ckpt)
    assert re.search(case.message, str(info.value)), str(info.value)
    assert "\n" not in str(info.value)
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- what must keep working
def _quiet_main(argv: list[str]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(argv)


@pytest.mark.parametrize("sub", ["test", "validate", "predict", "fit"])
def test_the_users_evaluation_options_win_over_the_checkpoints(sub, trained, tmp_path):
    """``--ckpt_path`` re-applies the saved hyperparameters (upstream Lightning); what the
    user states explicitly wins, and the run's own config file says so."""
    extra = ["--trainer.max_epochs=3"] if sub == "fit" else []
    run = _quiet_main([sub, "--config", str(SASREC), *TINY,
                       f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={trained}",
                       "--model.init_args.mask_history=false", "--model.init_args.ks=[3,7]",
                       "--trainer.limit_val_batches=2", *extra])  # fmt: skip
    # the shipped configs evaluate with seen items excluded (mask_history: true)
    assert run.model.mask_history is False and tuple(run.model.ks) == (3, 7)
    saved = torch.load(trained, weights_only=True)["hyper_parameters"]
    assert saved["mask_history"] is True and tuple(saved["ks"]) == (1, 5, 10, 20)
    config = run.config[sub]["model"]["init_args"]
    assert config["mask_history"] is False and tuple(config["ks"]) == (3, 7)
    if sub == "test":
        assert {"hr@3", "hr@7"} <= set(run.model.test_results)
        assert "hr@10" not in run.model.test_results


def test_options_the_user_did_not_state_keep_the_checkpoints(trained, tmp_path):
    run = _quiet_main(["test", "--config", str(SASREC), *TINY,
                       f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={trained}",
                       "--trainer.limit_test_batches=1"])  # fmt: skip
    assert run.model.mask_history is True and tuple(run.model.ks) == (1, 5, 10, 20)


def test_a_partial_test_is_marked_and_never_replaces_the_full_one(trained, tmp_path):
    report = tmp_path / "report"
    args = ["test", "--config", str(SASREC), *TINY, f"--trainer.default_root_dir={tmp_path}",
            f"--ckpt_path={trained}", f"--model.init_args.report_dir={report}",
            "--data.init_args.eval_batch_size=64"]  # fmt: skip
    _quiet_main(args)
    full = (report / "metrics.md").read_bytes()
    _quiet_main([*args, "--trainer.limit_test_batches=1"])
    assert (report / "metrics.md").read_bytes() == full
    partial = (report / "metrics_partial.md").read_text()
    assert re.search(r"\*\*Partial evaluation: 1 of \d+ test batches", partial)
    assert json.loads((report / "metrics_partial.json").read_text())["partial"].startswith("1 of")


def test_untrained_weights_run_only_when_asked(tmp_path):
    run = _quiet_main(["test", "--config", str(SASREC), *TINY,
                       f"--trainer.default_root_dir={tmp_path}", "--allow_untrained",
                       "--trainer.limit_test_batches=1"])  # fmt: skip
    assert run.model.test_results


def test_a_fit_with_no_training_batch_says_it_trained_nothing(tmp_path, capsys):
    _quiet_main(["fit", "--config", str(SASREC), *TINY, f"--trainer.default_root_dir={tmp_path}",
                 "--trainer.limit_train_batches=0", "--trainer.max_epochs=1",
                 "--trainer.callbacks=[]"])  # fmt: skip
    out = capsys.readouterr().out
    assert "trained nothing: no training step ran (limit_train_batches=0)" in out
    assert "last improved" not in out


def test_an_output_is_replaced_only_with_overwrite_and_it_says_so(trained, tmp_path, capsys):
    inp = tmp_path / "in"
    inp.mkdir()
    standard_inputs(inp, trained)
    argv = ["recommend", "--ckpt_path", str(inp / "model.ckpt"), "--input",
            str(inp / "hist.jsonl"), "--output", str(inp / "earlier.csv"), "--no-progress",
            "--overwrite"]  # fmt: skip
    with pytest.raises(SystemExit) as done:
        entry(argv)
    assert done.value.code == 0
    err = capsys.readouterr().err
    assert "(replaced the existing file: --overwrite)" in err
    assert (inp / "earlier.csv").read_text().startswith("user,rank,item,score,confidence\nu0,1,")


def test_a_checkpoint_from_before_digests_loads_with_a_warning(trained, tmp_path):
    """Never sealed, no digest record: it loads, saying it cannot be verified."""
    from bft_lightning.serving import Recommender
    from bft_lightning.utils import atomic_torch_save

    checkpoint = torch.load(trained, weights_only=True)
    checkpoint["bft_lightning"].pop("sealed")
    old = tmp_path / "old.ckpt"
    atomic_torch_save(checkpoint, old)  # no digest, as before digests existed
    with pytest.warns(UserWarning, match=re.escape(f"{old}: the checkpoint carries no content")):
        rec = Recommender.from_checkpoint(old)
    assert rec.num_items == len(item_ids(trained))


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize("command", ["recommend", "calibrate"])
def test_debug_shows_the_traceback_of_every_command(command, how, trained, tmp_path, monkeypatch):
    argv = [command, "--ckpt_path", str(tmp_path / "gone.ckpt"), "--input",
            str(tmp_path / "h.jsonl")]  # fmt: skip
    if command == "recommend":
        argv += ["--output", str(tmp_path / "r.csv")]
    (tmp_path / "h.jsonl").write_text('{"user": "a", "items": ["1", "2"]}\n')
    if how == "flag":
        argv.append("--debug")
    else:
        monkeypatch.setenv("BFT_DEBUG", "1")
    with pytest.raises((ValueError, FileNotFoundError), match="gone.ckpt"):
        entry(argv)


def test_the_help_lists_every_subcommand_in_whole_lines(capsys):
    with pytest.raises(SystemExit):
        entry(["--help"])
    out = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "recommend", "calibrate", "tune", "serve",
                 "export"):  # fmt: skip
        assert re.search(rf"^  {name} +\S.*[^,]$", out, re.MULTILINE), name
