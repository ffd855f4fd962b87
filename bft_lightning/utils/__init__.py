"""Run-time helpers: atomic, safely loaded checkpoints and exact mid-epoch resume.

- ``AtomicCheckpointIO``: a Lightning ``CheckpointIO`` that writes checkpoints
  to a temporary file in the target folder and renames it into place, and
  loads them with ``weights_only=True`` and clear errors.
- ``ResumableDataLoader``: a ``DataLoader`` that Lightning can resume mid-epoch
  (it records how many batches of the epoch were handed out).
- ``StepSeed``: a callback that reseeds torch before every training batch from
  ``(seed, epoch, batch, rank)``, so dropout and sampled negatives do not
  depend on what ran before (a resumed run draws the same numbers).
- ``LastCheckpoint``: ``last.ckpt`` on a step interval and at each epoch's end
  (what ``--ckpt_path last`` resumes), sweeping stale temporary files.
- ``EpochTimer``: seconds per training epoch, the epoch's validation left out.
"""

from bft_lightning.utils.checkpoint_io import (
    AtomicCheckpointIO,
    CheckpointLoadError,
    atomic_torch_save,
    safe_load_checkpoint,
)
from bft_lightning.utils.resume import (
    LastCheckpoint,
    ResumableDataLoader,
    StepSeed,
    sweep_temporary_files,
)
from bft_lightning.utils.timing import EpochTimer

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointLoadError",
    "EpochTimer",
    "LastCheckpoint",
    "ResumableDataLoader",
    "StepSeed",
    "atomic_torch_save",
    "safe_load_checkpoint",
    "sweep_temporary_files",
]
