"""Self-describing checkpoints: the vocabulary they hold, and data mapped through it."""

from __future__ import annotations

import random
import sys
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from recdata import cli_test_metrics, train  # noqa: E402

from bft_lightning.datamodules import SequenceDataModule  # noqa: E402
from bft_lightning.datamodules.cache import file_sha256  # noqa: E402
from bft_lightning.datamodules.readers import InteractionLog  # noqa: E402
from bft_lightning.datamodules.splits import encode, leave_one_out  # noqa: E402
from bft_lightning.datamodules.vocabulary import remap_items  # noqa: E402
from bft_lightning.models import SASRec  # noqa: E402
from bft_lightning.tasks import SequentialRecommendation  # noqa: E402
from bft_lightning.tasks.recommendation import backbone_spec  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, Path]:
    return train(tmp_path_factory.mktemp("cyclic"))


def shuffled_copy(src: Path, dst: Path, seed: int = 1) -> Path:
    lines = src.read_text().splitlines()
    random.Random(seed).shuffle(lines)
    dst.write_text("\n".join(lines) + "\n")
    return dst


def with_data(cfg: Path, data: Path, dst: Path) -> Path:
    dst.write_text(cfg.read_text().replace(f"path: {cfg.parent / 'cyclic.txt'}", f"path: {data}"))
    assert str(data) in dst.read_text()
    return dst


def test_checkpoint_holds_vocabulary_and_fingerprint(trained) -> None:
    ckpt, data, _ = trained
    info = torch.load(ckpt, weights_only=True)["bft_lightning"]
    vocab = info["vocabulary"]
    own = SequenceDataModule(path=str(data), max_len=8).sequences
    assert vocab["item_ids"] == [str(i) for i in own.item_ids] and vocab["item_ids"][0] == ""
    assert vocab["user_ids"] == [str(u) for u in own.user_ids]
    assert vocab["max_len"] == info["max_len"] == 8 and vocab["format"] == "s3rec"
    assert vocab["fingerprint"]["files"] == {data.name: file_sha256(data)}
    assert (vocab["fingerprint"]["users"], vocab["fingerprint"]["items"]) == (300, 20)
    assert vocab["fingerprint"]["interactions"] == len(own.items)
    assert torch.equal(vocab["item_frequency"], torch.from_numpy(leave_one_out(own).item_frequency))
    assert info["backbone_init"]["class_path"] == "bft_lightning.models.sasrec.SASRec"
    assert info["backbone_init"]["init_args"]["d_model"] == 16


def test_shuffled_copy_gives_the_same_test_metrics(trained, tmp_path) -> None:
    ckpt, data, cfg = trained
    copy = shuffled_copy(data, tmp_path / "shuffled.txt")
    # the copy numbers its items otherwise: without the vocabulary it would rank wrong items
    own = SequenceDataModule(path=str(copy), max_len=8).sequences.item_ids
    assert (
        list(own) != torch.load(ckpt, weights_only=True)["bft_lightning"]["vocabulary"]["item_ids"]
    )
    base = cli_test_metrics(cfg, ckpt)
    again = cli_test_metrics(with_data(cfg, copy, tmp_path / "c.yaml"), ckpt)
    assert base["hr@10"] > 0.5  # the cyclic pattern is learned
    assert again.keys() == base.keys()
    for key, value in base.items():
        assert again[key] == pytest.approx(value, abs=1e-6), key


def test_shuffled_copy_through_the_trainer_api(trained, tmp_path) -> None:
    ckpt, data, _ = trained
    spec = torch.load(ckpt, weights_only=True)["bft_lightning"]["backbone_init"]["init_args"]
    results = []
    for path in (data, shuffled_copy(data, tmp_path / "shuffled.txt")):
        dm = SequenceDataModule(path=str(path), max_len=8)
        task = SequentialRecommendation(dm.num_items, 8, backbone=partial(SASRec, **spec))
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
        trainer.test(task, dm, ckpt_path=str(ckpt), verbose=False)  # remapped on load
        results.append(task.test_results)
    assert results[1]["hr@10"] == pytest.approx(results[0]["hr@10"], abs=1e-6)
    assert results[1]["ndcg@10"] == pytest.approx(results[0]["ndcg@10"], abs=1e-6)


def test_unknown_items_are_counted_and_reported(trained, tmp_path) -> None:
    ckpt, data, cfg = trained
    lines = data.read_text().splitlines()
    lines[0] = lines[0].split()[0] + " 7777 " + " ".join(lines[0].split()[1:])  # history only
    lines[1] = lines[1] + " 8888"  # a test target the checkpoint never saw
    lines.append("9999 7777 8888 7777")  # a user of unknown items only
    extended = tmp_path / "extended.txt"
    extended.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning) as caught:
        got = cli_test_metrics(with_data(cfg, extended, tmp_path / "e.yaml"), ckpt)
    text = " ".join(str(w.message) for w in caught)
    assert "2 item ids of the data are not in the checkpoint's vocabulary" in text
    assert "'7777', '8888'" in text and "their 5 interactions are dropped" in text
    assert "2 users are left out" in text and "2 users of the data are not evaluated" in text
    assert got["n"] == 299  # user 2 (unknown test item) is not scored; user 1 is, without 7777


def test_checkpoint_without_vocabulary_warns(trained, tmp_path) -> None:
    ckpt, data, cfg = trained
    checkpoint = torch.load(ckpt, weights_only=True)
    del checkpoint["bft_lightning"]["vocabulary"]
    checkpoint["bft_lightning"].pop("sealed", None)  # as saved before checkpoints were sealed
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    with pytest.warns(UserWarning, match="holds no item vocabulary .* cannot check"):
        got = cli_test_metrics(cfg, old)
    base = cli_test_metrics(cfg, ckpt)
    assert got["hr@1"] == pytest.approx(base["hr@1"])  # the training file: the same ids
    # a reordered copy, which the vocabulary maps right, ranks the wrong items without it
    copy = with_data(cfg, shuffled_copy(data, tmp_path / "shuffled.txt"), tmp_path / "s.yaml")
    with pytest.warns(UserWarning, match="holds no item vocabulary"):
        wrong = cli_test_metrics(copy, old)
    # (on a cycle, numbering by first appearance partly preserves successors: 0.85 vs 1.0)
    assert base["hr@1"] > 0.8 and wrong["hr@1"] < base["hr@1"] - 0.05, (base, wrong)


def test_remap_items_keeps_the_split() -> None:
    log = InteractionLog(
        users=["a", "b", "c", "d"],
        sequences=[["x", "new", "y", "z"], ["x", "y", "new"], ["new"], ["y", "x", "z", "x"]],
    )  # fmt: skip
    data = encode(log)
    remapped, report = remap_items(data, ["", "z", "y", "x"])
    assert report.unknown_items == ("new",) and report.unknown_interactions == 3
    assert report.users_left_out == 2  # b (its test item) and c (nothing known)
    assert report.eval_users_lost == 1  # b; a keeps 3 items and stays evaluated
    assert list(remapped.user_ids) == ["a", "d"] and remapped.num_items == 3
    ids = remapped.item_ids
    assert [[str(ids[i]) for i in remapped.items[s:e]]
            for s, e in zip(remapped.offsets[:-1], remapped.offsets[1:])] == [
        ["x", "y", "z"], ["y", "x", "z", "x"]]  # fmt: skip
    assert np.array_equal(remapped.items[:3], [3, 2, 1])


def test_backbone_spec_rebuilds_the_backbone() -> None:
    factory = partial(SASRec, d_model=16, nhead=2, num_layers=1)
    task = SequentialRecommendation(12, 6, backbone=factory)
    spec = task.backbone_spec
    assert spec == {"class_path": "bft_lightning.models.sasrec.SASRec",
                    "init_args": {"d_model": 16, "nhead": 2, "num_layers": 1}}  # fmt: skip
    rebuilt = SASRec(12, 6, **spec["init_args"])
    rebuilt.load_state_dict(task.model.state_dict())
    assert backbone_spec(lambda n, m: SASRec(n, m), SASRec) is None
    assert SequentialRecommendation(12, 6).backbone_spec["init_args"] == {}


def test_predict_writes_every_users_next_items(trained, tmp_path) -> None:
    from bft_lightning.cli import main

    ckpt, data, cfg = trained
    out = tmp_path / "next.jsonl"
    main(["predict", "--config", str(cfg), "--ckpt_path", str(ckpt),
          "--trainer.callbacks+=bft_lightning.serving.RecommendationWriter",
          f"--trainer.callbacks.output={out}", "--trainer.callbacks.k=3"])  # fmt: skip
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    users = [line.split() for line in data.read_text().splitlines()]
    assert len(rows) == 3 * len(users)
    last = {u[0]: u[-1] for u in users}
    firsts = {r["user"]: r["item"] for r in rows if r["rank"] == 1}
    assert set(firsts) == set(last)
    # after the full history (test item included), the next item of the cycle
    hits = sum(firsts[u] == str(1001 + (int(last[u]) - 1001 + 1) % 20) for u in last)
    assert hits >= 0.9 * len(last)


def test_predict_default_writer(trained, tmp_path) -> None:
    from bft_lightning.cli import main

    ckpt, _, cfg = trained
    main(["predict", "--config", str(cfg), "--ckpt_path", str(ckpt),
          f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    lines = (tmp_path / "predictions.csv").read_text().splitlines()
    assert lines[0] == "user,rank,item,score,confidence" and len(lines) == 1 + 10 * 300
