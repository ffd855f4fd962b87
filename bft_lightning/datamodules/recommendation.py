"""``SequenceDataModule``: next-item recommendation data for LightningCLI.

Batches are dicts of tensors; this interface is what the models and tasks use.

Train (one row per user whose training part has >= 2 items; shuffled with ``seed``):
    ``seq`` ``(B, max_len+1)`` long: the most recent ``max_len + 1`` items of the
    user's training part, left-padded with 0. A model reads ``seq[:, :-1]`` and
    predicts ``seq[:, 1:]`` (0 = no target), so every item after the first is a
    target of the prefix before it. Longer training parts keep only their most
    recent window (SASRec practice).
    ``user`` ``(B,)`` long: 0-based user index over all users.
    ``seq_time`` ``(B, max_len+1)`` long unix seconds, 0 at padding (only with timestamps).
    With ``train_rows="prefix"`` a row per training target instead, ending at it,
    and ``num_targets`` ``(B,)`` long (1): only the row's last item is a target.

Validation / test (one row per user with >= 3 items; not shuffled):
    ``input_ids`` ``(B, max_len)`` long: left-padded history before the target
    (validation: ``items[:-2]``; test: ``items[:-1]``).
    ``target`` ``(B,)`` long: ``items[-2]`` (validation) or ``items[-1]`` (test).
    ``user`` ``(B,)`` long: 0-based row in the evaluation set (same for both).
    ``history_len`` ``(B,)`` long: the full history length before truncation.
    ``input_time`` ``(B, max_len)`` and ``target_time`` ``(B,)`` (only with timestamps).

Users with fewer than 3 items train only and are never evaluated; see
:mod:`.splits` for all split rules; data with no evaluated user or no training
row is refused. Under DDP, Lightning's ``DistributedSampler`` may repeat a few
evaluation rows to even out ranks; the ``user`` index lets the ranking metric
count every user exactly once. Training rows are sharded by
``DistributedLengthBucketSampler``: N processes with ``batch_size`` b see the
global batches one process with batch N*b would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from bft_lightning.utils.resume import ResumableDataLoader

from . import shards
from .arrays import ArrayDataset, Batch, collate_arrays  # noqa: F401 (public path)
from .cache import load_sequences
from .noise import corrupt_training_items
from .readers import kcore_filter
from .registry import default_data_root, resolve_dataset
from .sampling import DistributedLengthBucketSampler, LengthBucketSampler
from .splits import (
    LeaveOneOut,
    SequenceData,
    encode,
    eval_arrays,
    leave_one_out,
    predict_arrays,
    repeat_rate,
    train_arrays,
)
from .splits import (
    check_enough as _check_enough,
)
from .synthetic import SyntheticConfig, make_synthetic
from .vocabulary_state import CheckpointVocabulary
from .windows import PrefixRows

__all__ = [
    "ArrayDataset",
    "DistributedLengthBucketSampler",
    "LengthBucketSampler",
    "SequenceDataModule",
    "collate_arrays",
]


class SequenceDataModule(CheckpointVocabulary, L.LightningDataModule):
    """Leave-one-out next-item data: synthetic, a shared dataset, or a file.

    Args:
        dataset: ``"synthetic"`` (built in, no files) or a dataset name: a folder
            under ``data_root`` such as ``"amazon-beauty-s3rec"``, ``"ml-1m"``, or
            ``"amazon2014-<Category>"``; file and format are looked up.
        data_root: folder holding the dataset folders; None: ``$BFT_DATA_ROOT``, else
            ``data`` under the working directory.
        path: explicit interaction file; overrides ``dataset``.
        format: reader for ``path``: ``"s3rec"``, ``"pairs"``, ``"json"``,
            ``"recbole"``, ``"movielens"``, ``"amazon"`` or ``"parquet"``; ``None`` sniffs it.
        max_len: history length fed to the model (train rows hold ``max_len + 1``).
        batch_size: training batch size.
        eval_batch_size: validation / test batch size.
        num_workers: DataLoader worker processes.
        kcore: iterative user/item k-core applied after reading (0 = off).
        cache_dir: folder for the processed, memory-mapped ``.npy`` cache (``None`` = no cache).
        download: fetch downloadable datasets (MovieLens-1M, Amazon 5-core) if missing.
        seed: seed of the training shuffle (epoch ``e`` uses ``seed + e``).
        bucket_by_length: batch training rows of similar length together (see
            ``LengthBucketSampler``; less padding, so less time per epoch:
            ``results/perf/notes.md``); False gives a plain shuffle. Bucketed batches hold very
            different numbers of targets, so the task must not average its loss
            per batch over targets (``SequentialRecommendation``'s
            ``loss_normalization="rows"``, its default). Either way the
            order is pinned per epoch, sharded over DDP processes by the data
            module itself, and the loader resumes mid-epoch
            (``bft_lightning.utils.ResumableDataLoader``).
        train_rows: ``"user"`` (one row per user, every position a target) or
            ``"prefix"`` (one row per target ending at it, loss only at the
            row's last position, as RecBole serves SASRec; see
            :func:`~.splits.train_arrays`). The same targets either way (prefix
            rows also keep those a ``max_len`` window cuts from long
            histories), but ``"prefix"`` takes about ``mean history length / 2``
            times the encoder compute per epoch; its rows are cut per batch
            (:class:`~.windows.PrefixRows`), so their memory stays that of
            the interactions. BERT4Rec's
            cloze objective masks items anywhere in a row, so for it prefix
            rows only repeat (augment) the data.
        synthetic_users: users of the synthetic dataset.
        synthetic_items: items of the synthetic dataset.
        synthetic_clusters: item clusters (user tastes) of the synthetic dataset.
        synthetic_seed: seed of the synthetic dataset (independent of ``seed``).
        shard_users: under DDP, each process builds and serves only its own
            contiguous range of users (about ``1 / world`` of the interactions):
            its training rows and its validation / test rows (see
            :mod:`.shards`); every user is evaluated once, so the metrics are
            those of one process. Off (default): every process builds every
            row and the samplers split them.
        item_vocabulary: a recommendation checkpoint whose item vocabulary the
            data is encoded in (``--ckpt_path`` sets it on the command line):
            raw item ids get the checkpoint's indices whatever the order of the
            file's lines; items it has never seen are dropped and counted (see
            :func:`~.vocabulary.remap_items`). None: items are numbered in order
            of first appearance.
        allow_other_data: encode the data in a checkpoint's vocabulary even when it
            is not the data the checkpoint was trained on (another fingerprint with
            little overlap, or another reader format; ``datamodules.data_match``).
            Off: that is an error naming both data sets.
        train_noise: share of the training items (every item but each evaluated
            user's validation and test targets) replaced by a uniformly random other
            item, to test robustness to noisy histories; validation and test targets
            stay clean (see :mod:`.noise`). 0 (default): the data as read.
        train_noise_seed: seed of that corruption (the same on every process and run).
    """

    def __init__(
        self,
        dataset: str = "synthetic",
        data_root: str | None = None,
        path: str | None = None,
        format: str | None = None,
        max_len: int = 50,
        batch_size: int = 256,
        eval_batch_size: int = 512,
        num_workers: int = 0,
        kcore: int = 0,
        cache_dir: str | None = None,
        download: bool = False,
        seed: int = 0,
        bucket_by_length: bool = True,
        train_rows: str = "user",
        synthetic_users: int = 2000,
        synthetic_items: int = 500,
        synthetic_clusters: int = 20,
        synthetic_seed: int = 0,
        item_vocabulary: str | None = None,
        shard_users: bool = False,
        train_noise: float = 0.0,
        train_noise_seed: int = 0,
        allow_other_data: bool = False,
    ) -> None:
        super().__init__()
        for name, value, low in [
            ("max_len", max_len, 1), ("batch_size", batch_size, 1),
            ("eval_batch_size", eval_batch_size, 1), ("num_workers", num_workers, 0),
            ("kcore", kcore, 0), ("synthetic_users", synthetic_users, 1),
            ("synthetic_items", synthetic_items, 1), ("synthetic_clusters", synthetic_clusters, 1),
        ]:  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"SequenceDataModule: {name} must be an integer >= {low}, got {value!r}"
                )
        if train_rows not in ("user", "prefix"):
            raise ValueError(
                f"SequenceDataModule: train_rows must be 'user' or 'prefix', got {train_rows!r}"
            )
        for name, value in (("seed", seed), ("synthetic_seed", synthetic_seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"SequenceDataModule: {name} must be an integer >= 0, got {value!r}"
                )
        if (
            isinstance(train_noise, bool)
            or not isinstance(train_noise, (int, float))
            or not (0.0 <= train_noise <= 1.0)
        ):
            raise ValueError(
                f"SequenceDataModule: train_noise must be a number in [0, 1], got {train_noise!r}"
            )
        if isinstance(train_noise_seed, bool) or not isinstance(train_noise_seed, int):
            raise ValueError(
                f"SequenceDataModule: train_noise_seed must be an integer, got {train_noise_seed!r}"
            )
        self.save_hyperparameters()
        self.train_noise, self.train_noise_seed = float(train_noise), train_noise_seed
        self.noise_mask: np.ndarray | None = None  # (N,) True where an item was replaced
        self.train_rows = train_rows
        self.dataset, self.path, self.format = dataset, path, format
        self.data_root = str(default_data_root() if data_root is None else data_root)
        self.max_len, self.batch_size, self.eval_batch_size = max_len, batch_size, eval_batch_size
        self.num_workers, self.kcore, self.cache_dir = num_workers, kcore, cache_dir
        self.download, self.seed, self.bucket_by_length = download, seed, bucket_by_length
        self.synthetic = SyntheticConfig(
            num_users=synthetic_users,
            num_items=synthetic_items,
            num_clusters=synthetic_clusters,
            seed=synthetic_seed,
        )
        self.item_vocabulary = item_vocabulary
        if not isinstance(allow_other_data, bool):
            raise ValueError(
                f"SequenceDataModule: allow_other_data must be true or false, got "
                f"{allow_other_data!r}"
            )
        self.allow_other_data = allow_other_data
        self.shard_users = bool(shard_users)
        self._built_for: tuple[int, int] | None = None  # the shard the datasets were built for
        self._data: SequenceData | None = None
        self._split: LeaveOneOut | None = None
        self._fingerprint: dict[str, Any] | None = None
        self._datasets: dict[str, ArrayDataset | PrefixRows | shards.EvalShard] = {}

    # ------------------------------------------------------------ loading

    def _source(self) -> tuple[Path, str | None]:
        """The interaction file and its format (``None`` = sniff)."""
        if self.path is not None:
            return Path(self.path), self.format
        path, fmt = resolve_dataset(self.dataset, self.data_root, self.download)
        return path, self.format or fmt

    def _read(self) -> SequenceData:
        """Build or read the remapped sequences."""
        if self.path is None and self.dataset == "synthetic":
            return encode(kcore_filter(make_synthetic(self.synthetic), self.kcore))
        path, fmt = self._source()
        source = self._describe()

        def enough(data: SequenceData) -> None:  # before a cache file is written
            _check_enough(data, leave_one_out(data), source)

        return load_sequences(path, fmt, self.kcore, self.cache_dir, validate=enough)

    def _describe(self) -> str:
        """The data source, for messages."""
        if self.path is not None:
            return str(self.path)
        where = "" if self.dataset == "synthetic" else f" under {self.data_root}"
        return f"dataset {self.dataset!r}{where}"

    def prepare_data(self) -> None:
        """Download (if asked) and write the cache; Lightning runs this on one process."""
        if self.path is None and self.dataset != "synthetic":
            self._source()
        if self.cache_dir is not None:
            self._ensure()

    def _ensure(self) -> tuple[SequenceData, LeaveOneOut]:
        """Load data and split once (lazily; safe to call from properties)."""
        if self._data is None or self._split is None:
            data = self._read()
            if self.item_vocabulary is not None:
                data = self._remap(data, self.item_vocabulary)
            data, self.noise_mask = corrupt_training_items(
                data, self.train_noise, self.train_noise_seed
            )
            split = leave_one_out(data)
            _check_enough(data, split, self._describe())
            self._data, self._split = data, split
            rank_zero_info(f"SequenceDataModule: {self.stats}")
        return self._data, self._split

    def setup(self, stage: str | None = None) -> None:
        """Load the data (every process) and pre-build the padded arrays."""
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",),
                  "predict": ("predict",)}  # fmt: skip
        for name in wanted.get(stage or "", ("train", "val", "test")):
            self._dataset(name)

    def _dataset(self, name: str) -> ArrayDataset | PrefixRows | shards.EvalShard:
        """The ``train`` / ``val`` / ``test`` dataset, built on first use."""
        shard = self._shard()
        if shard != self._built_for:
            self._datasets.clear()
            self._built_for = shard
        if name not in self._datasets:
            data, split = self._ensure()
            if shard is not None and name != "predict":
                self._datasets[name] = shards.shard_dataset(
                    name, data, split, self.max_len, self.train_rows == "prefix", *shard
                )
            elif name == "train" and self.train_rows == "prefix":  # windows cut per batch
                self._datasets[name] = PrefixRows(data, split, self.max_len)
            elif name == "train":
                self._datasets[name] = ArrayDataset(train_arrays(data, split, self.max_len))
            elif name == "predict":
                self._datasets[name] = ArrayDataset(predict_arrays(data, self.max_len))
            else:
                self._datasets[name] = ArrayDataset(eval_arrays(data, split, self.max_len, name))
        return self._datasets[name]

    # ------------------------------------------------------------ properties

    @property
    def sequences(self) -> SequenceData:
        """The remapped sequences (loads the data if needed)."""
        return self._ensure()[0]

    @property
    def split(self) -> LeaveOneOut:
        """The leave-one-out split (loads the data if needed)."""
        return self._ensure()[1]

    @property
    def num_items(self) -> int:
        """Number of items; ids run ``1..num_items`` and ``0`` is padding."""
        return self.sequences.num_items

    @property
    def num_users(self) -> int:
        """Number of users (training and evaluated)."""
        return self.sequences.num_users

    @property
    def item_frequency(self) -> torch.Tensor:
        """``(num_items+1,)`` long: item counts over the training parts; ``[0] == 0``."""
        return torch.from_numpy(self.split.item_frequency.copy())

    @property
    def repeat_rate(self) -> float:
        """Share of training targets already in their own history (:func:`.splits.repeat_rate`):
        recorded in checkpoints, where it picks whether recommendations exclude seen items
        by default."""
        return repeat_rate(*self._ensure())

    @property
    def has_time(self) -> bool:
        """Whether batches carry ``seq_time`` / ``input_time`` / ``target_time``."""
        return self.sequences.times is not None

    @property
    def stats(self) -> dict[str, int]:
        """Counts for logs: users, items, interactions, evaluated and short users."""
        data, split = self._data, self._split
        assert data is not None and split is not None
        return {
            "users": data.num_users,
            "items": data.num_items,
            "interactions": len(data.items),
            "eval_users": len(split.eval_users),
            "short_users": split.num_short_users,
            "untrainable_users": split.num_untrainable_users,
        }

    # ------------------------------------------------------------ loaders

    def _replicas(self) -> tuple[int, int]:
        """``(world size, global rank)`` of the attached trainer; ``(1, 0)`` without one."""
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return int(trainer.world_size), int(trainer.global_rank)

    def _shard(self) -> tuple[int, int] | None:
        """``(world, rank)`` when this process serves only its users' rows, else ``None``."""
        world, rank = self._replicas()
        return (world, rank) if self.shard_users and world > 1 else None

    def _loader(self, name: str, batch_size: int, shuffle: bool) -> DataLoader:
        """A DataLoader over a pre-built dataset with the stacking collate.

        Training: an epoch-seeded ``LengthBucketSampler`` (without bucketing,
        ``pool_batches=1``: a plain shuffle), sharded over the trainer's
        processes, in a ``ResumableDataLoader`` (exact mid-epoch resume).
        """
        kwargs: dict[str, Any] = {}
        dataset = self._dataset(name)
        loader_class: type[DataLoader] = DataLoader
        if shuffle:
            if isinstance(dataset, PrefixRows):
                lengths = dataset.row_lengths()
            else:
                lengths = (dataset.arrays["seq"] != 0).sum(axis=1)
            world, rank = self._replicas()
            pools = 50 if self.bucket_by_length else 1
            if self._shard() is not None:
                kwargs["sampler"] = shards.ShardBucketSampler(
                    lengths, batch_size, shards.epoch_rows(self, world), self.seed, pools,
                    num_replicas=world, rank=rank,
                )  # fmt: skip
            else:
                sampler_class = DistributedLengthBucketSampler if world > 1 else LengthBucketSampler
                kwargs["sampler"] = sampler_class(
                    lengths, batch_size, self.seed, pool_batches=pools, num_replicas=world,
                    rank=rank,
                )  # fmt: skip
            shuffle = False
            loader_class = ResumableDataLoader
        elif isinstance(dataset, shards.EvalShard):
            kwargs["sampler"] = shards.ShardSampler(dataset.start, dataset.stop, *self._replicas())
        workers = self.num_workers
        return loader_class(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=False,
            num_workers=workers,
            persistent_workers=workers > 0,
            collate_fn=collate_arrays,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training rows (``seq``, ``user``, optional ``seq_time`` and ``num_targets``)."""
        return self._loader("train", self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation rows, in user order."""
        return self._loader("val", self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test rows, in user order."""
        return self._loader("test", self.eval_batch_size, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """Every user's full history (test item included), for ``predict``: what comes next."""
        return self._loader("predict", self.eval_batch_size, shuffle=False)
