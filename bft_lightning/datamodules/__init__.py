"""Sequence data for next-item recommendation: readers, splits, synthetic data.

The public entry point is :class:`SequenceDataModule`; the readers, the
leave-one-out split, the processed cache and the downloads are usable alone.
"""

from .cache import load_sequences
from .download import DownloadError, RemoteFile, amazon_remote, download_file
from .readers import FORMATS, InteractionLog, kcore_filter, read_interactions, sniff_format
from .recommendation import ArrayDataset, SequenceDataModule, collate_arrays
from .registry import KNOWN_DATASETS, resolve_dataset
from .splits import LeaveOneOut, SequenceData, encode, eval_arrays, leave_one_out, train_arrays
from .synthetic import SyntheticConfig, make_synthetic

__all__ = [
    "FORMATS",
    "KNOWN_DATASETS",
    "ArrayDataset",
    "DownloadError",
    "InteractionLog",
    "LeaveOneOut",
    "RemoteFile",
    "SequenceData",
    "SequenceDataModule",
    "SyntheticConfig",
    "amazon_remote",
    "collate_arrays",
    "download_file",
    "encode",
    "eval_arrays",
    "kcore_filter",
    "leave_one_out",
    "load_sequences",
    "make_synthetic",
    "read_interactions",
    "resolve_dataset",
    "sniff_format",
    "train_arrays",
]
