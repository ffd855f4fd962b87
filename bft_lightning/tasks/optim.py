"""Moved to :mod:`bft_lightning.utils.optim`;
this name is kept for old imports and saved configs."""

from bft_lightning.utils.moved import alias_module

alias_module(__name__, "bft_lightning.utils.optim")
