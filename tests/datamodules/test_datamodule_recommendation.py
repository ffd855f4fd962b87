"""``SequenceDataModule``: lazy properties, the fixed batch interface, loaders, CLI."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from jsonargparse import ArgumentParser
from torch.utils.data import DistributedSampler

from bft_lightning.datamodules import SequenceDataModule

SMALL = {"synthetic_users": 300, "synthetic_items": 120, "synthetic_clusters": 6, "max_len": 8}


@pytest.fixture(scope="module")
def dm():
    return SequenceDataModule(batch_size=32, eval_batch_size=64, **SMALL)


def test_properties_load_lazily_after_construction(dm):
    fresh = SequenceDataModule(**SMALL)
    assert fresh._data is None
    assert fresh.num_items == dm.num_items > 100  # read before any setup, as the CLI does
    freq = fresh.item_frequency
    assert freq.shape == (fresh.num_items + 1,) and freq.dtype == torch.long and freq[0] == 0
    assert fresh.num_users == 300 and fresh.has_time and fresh.max_len == 8


def test_train_batch_interface(dm):
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"seq", "user", "seq_time"}
    assert batch["seq"].shape == (32, 9) and batch["seq"].dtype == torch.long
    assert batch["user"].shape == (32,) and batch["seq_time"].shape == (32, 9)
    assert ((batch["seq_time"] == 0) == (batch["seq"] == 0)).all()
    real = batch["seq"] != 0  # left padding: once a row starts it never pads again
    assert (real[:, 1:] >= real[:, :-1]).all() and real[:, -1].all()
    assert int(batch["seq"].max()) <= dm.num_items


@pytest.mark.parametrize("stage", ["val", "test"])
def test_eval_batch_interface(dm, stage):
    dm.setup("fit" if stage == "val" else "test")
    loader = dm.val_dataloader() if stage == "val" else dm.test_dataloader()
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "target", "user", "history_len", "input_time", "target_time"}
    assert batch["input_ids"].shape == (64, 8) and batch["target"].shape == (64,)
    assert batch["user"].tolist() == list(range(64))  # in order, not shuffled
    assert (batch["history_len"] >= (batch["input_ids"] != 0).sum(1)).all()
    assert (batch["target_time"] > batch["input_time"].max(1).values).all()


def test_shuffle_follows_seed():
    def first_users(seed):
        d = SequenceDataModule(seed=seed, batch_size=16, **SMALL)
        return next(iter(d.train_dataloader()))["user"].tolist()

    assert first_users(0) == first_users(0) != first_users(1)


def test_validation_is_the_prefix_of_test(dm):
    val = dm._dataset("val").arrays
    test = dm._dataset("test").arrays
    assert np.array_equal(test["input_ids"][:, -1], val["target"])
    assert np.array_equal(test["history_len"], val["history_len"] + 1)


def test_each_eval_user_once_under_ddp_sampler(dm):
    dataset = dm._dataset("test")
    seen: list[int] = []
    for rank in range(7):
        sampler = DistributedSampler(dataset, num_replicas=7, rank=rank, shuffle=False)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=50, sampler=sampler, collate_fn=dm.test_dataloader().collate_fn
        )
        seen += [u for b in loader for u in b["user"].tolist()]
    assert len(seen) > len(dataset)  # the sampler padded with repeats ...
    assert sorted(set(seen)) == list(range(len(dataset)))  # ... which `user` de-duplicates


def test_explicit_path_without_timestamps(write, tmp_path):
    path = write("d.txt", "1 1 2 3 4\n2 5 6\n3 2 3 4 5 6 7\n")
    d = SequenceDataModule(path=str(path), max_len=3, cache_dir=str(tmp_path / "cache"))
    d.prepare_data()
    assert list((tmp_path / "cache").iterdir())  # the cache was written
    assert d.num_items == 7 and d.stats["short_users"] == 1 and d.stats["eval_users"] == 2
    assert set(next(iter(d.train_dataloader()))) == {"seq", "user"}
    batch = next(iter(d.test_dataloader()))
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 6]] and batch["target"].tolist() == [
        4,
        7,
    ]
    assert batch["history_len"].tolist() == [3, 5]


def test_shared_dataset_by_name(data_root):
    if not (data_root / "lastfm-s3rec").is_dir():
        pytest.skip("lastfm-s3rec not present")
    d = SequenceDataModule(dataset="lastfm-s3rec", data_root=str(data_root))
    assert (d.num_items, d.num_users) == (3646, 1090) and not d.has_time


def test_constructor_arguments_become_cli_help():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(SequenceDataModule, "data")
    help_text = parser.format_help()
    assert "history length fed to the model" in help_text
    cfg = parser.parse_args(["--data.dataset=yelp-s3rec", "--data.max_len=20", "--data.kcore=5"])
    assert cfg.data.dataset == "yelp-s3rec" and cfg.data.max_len == 20 and cfg.data.kcore == 5


class _CountUsers(L.LightningModule):
    """Consumes the batch interface; counts evaluated users."""

    def __init__(self, num_items: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(num_items + 1, 4)
        self.seen: list[int] = []

    def training_step(self, batch, _):
        targets = batch["seq"][:, 1:]
        return self.emb(targets)[targets != 0].pow(2).mean()

    def test_step(self, batch, _):
        self.seen += batch["user"].tolist()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*")
def test_trainer_fit_and_test(dm):
    model = _CountUsers(dm.num_items)
    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=dm.train_dataloader())
    trainer.test(model, datamodule=dm)
    assert model.seen == list(range(dm.stats["eval_users"]))
