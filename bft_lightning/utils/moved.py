"""Old module names kept working after a move: the old name becomes the new module.

A module that moved leaves a two-line file at its old path that calls
:func:`alias_module`: ``import bft_lightning.models.llama`` (an old import, or a
``class_path`` in a saved config) then gives the very module
``bft_lightning.lm.model``, so its classes are the same objects (``isinstance``,
pickles and ``class_path`` all agree), with a ``DeprecationWarning`` naming the
new place.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def alias_module(old: str, new: str) -> None:
    """Make ``old`` (the calling module's name) the module ``new``, with a warning."""
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old name will be removed)",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
