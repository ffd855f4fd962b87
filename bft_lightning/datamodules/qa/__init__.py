"""Moved to :mod:`bft_lightning.lm.data.qa`; this package is kept for old imports and
saved configs (``class_path: bft_lightning.datamodules.qa.QADataModule``): its names
are the new package's, and each old submodule is the new one."""

import warnings

from bft_lightning.lm.data.qa import *  # noqa: F403
from bft_lightning.lm.data.qa import (  # noqa: F401  (the submodules, as attributes)
    __all__,
    batching,
    datamodule,
    encoding,
    examples,
    noise,
    pretrain,
    readers,
)

warnings.warn(
    "bft_lightning.datamodules.qa moved to bft_lightning.lm.data.qa; import it from there "
    "(the old name will be removed)",
    DeprecationWarning,
    stacklevel=2,
)
