"""Moved to :mod:`bft_lightning.lm.data.qa.readers`;
this name is kept for old imports and saved configs."""

from bft_lightning.utils.moved import alias_module

alias_module(__name__, "bft_lightning.lm.data.qa.readers")
