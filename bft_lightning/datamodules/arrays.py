"""Datasets of pre-built numpy rows and their collate (a whole batch per fancy index)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["ArrayDataset", "Batch", "collate_arrays"]

Batch = dict[str, torch.Tensor]


class ArrayDataset(Dataset):
    """Rows of pre-built, equally long numpy arrays.

    ``__getitems__`` returns a whole batch by one fancy index per array, so the
    DataLoader never loops over rows in Python.
    """

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self._len = len(next(iter(arrays.values())))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v[index] for k, v in self.arrays.items()}

    def __getitems__(self, indices: list[int]) -> dict[str, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        return {k: v[idx] for k, v in self.arrays.items()}


def collate_arrays(batch: dict[str, np.ndarray] | list[dict[str, np.ndarray]]) -> Batch:
    """Tensors from a batched dict (``__getitems__``) or a list of row dicts."""
    if isinstance(batch, list):
        batch = {k: np.stack([row[k] for row in batch]) for k in batch[0]}
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}
