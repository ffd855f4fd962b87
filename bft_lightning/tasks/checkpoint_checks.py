"""What a recommendation checkpoint records beside the weights, and the checks on loading it.

The record itself (key, fields, reader, writer) is
:mod:`bft_lightning.utils.checkpoint_format`. Here: how a backbone factory is
recorded (:func:`backbone_spec`), and the checks that turn a checkpoint from
another model or other data into one clear error.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from bft_lightning.utils.checkpoint_format import CheckpointRecord, read_record


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def related(class_path: str, cls: type) -> bool:
    """Whether ``class_path`` names ``cls``, a subclass or a base class of it."""
    module, _, name = class_path.rpartition(".")
    try:
        saved = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return class_path == qualname(cls)
    return isinstance(saved, type) and (issubclass(cls, saved) or issubclass(saved, cls))


def _plain(value: object) -> bool:
    """A value a ``weights_only`` checkpoint load accepts and a config could name."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _record(value: object) -> object:
    """A dataclass instance as the dict of its fields (which its class rebuilds)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def backbone_spec(backbone: object, built: type, default: object = None) -> dict[str, Any] | None:
    """``{"class_path", "init_args"}`` that rebuild ``backbone(num_items, max_len)``.

    Read from the factory: ``default`` (the task's default factory), a class,
    or a ``functools.partial`` of the class (what code writes) or of an
    instantiator and the class (what LightningCLI builds from ``class_path`` /
    ``init_args``). None when the factory is something else or holds values
    that are not plain data.
    """
    if (default is not None and backbone is default) or backbone is built:
        return {"class_path": qualname(built), "init_args": {}}
    if not isinstance(backbone, functools.partial):
        return None
    func, args = backbone.func, backbone.args
    if isinstance(func, type) and not args:
        cls = func
    elif args and isinstance(args[-1], type) and not any(isinstance(a, type) for a in args[:-1]):
        cls = args[-1]  # instantiator(*wrappers, cls, num_items, max_len, **init_args)
    else:
        return None
    # a typed option (the backbone's FilterConfig) is recorded as its fields
    kwargs = {k: _record(v) for k, v in backbone.keywords.items()}
    if cls is not built or not _plain(kwargs):
        return None
    return {"class_path": qualname(cls), "init_args": kwargs}


def use_checkpoint_vocabulary(datamodule: object, checkpoint: dict[str, Any], source: str) -> None:
    """Encode the attached data in the checkpoint's item ids; warn if it has none.

    Runs before any loader of the stage is built, so evaluation, prediction
    and a resumed fit all see the checkpoint's indices.
    """
    use = getattr(datamodule, "use_vocabulary", None)
    if not callable(use):
        return
    vocabulary = (read_record(checkpoint) or CheckpointRecord()).vocabulary
    if vocabulary is None:
        rank_zero_warn(
            f"{source}: the checkpoint holds no item vocabulary (saved before checkpoints "
            "stored one): cannot check that the data's item ids are those it was trained "
            "on, nor map a reordered or extended data file; ids are taken in the data's "
            "order of first appearance"
        )
        return
    use(vocabulary, source)


def check_checkpoint(
    checkpoint: dict[str, Any],
    model: nn.Module,
    own: dict[str, Tensor],
    num_items: int,
    strict: bool,
    source: str = "checkpoint",
) -> None:
    """Raise a clear ``ValueError`` if ``checkpoint`` cannot be that of a task whose
    backbone is ``model``, state dict ``own`` and item count ``num_items``.

    Checks, in order: a Lightning checkpoint with a ``state_dict``; the
    backbone class it was saved from (the same, a subclass or a base); its
    ``num_items``; the parameter names (if ``strict``) and shapes; finite
    values in every floating-point tensor.
    """
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        raise ValueError(f"{source}: not a Lightning checkpoint (no state_dict)")
    info = read_record(checkpoint) or CheckpointRecord()
    saved = info.backbone
    if saved is not None and not related(saved, type(model)):
        raise ValueError(
            f"{source}: checkpoint from another model: its backbone is {saved}, "
            f"this run builds {qualname(type(model))}"
        )
    hparams = checkpoint.get("hyper_parameters") or {}
    saved_items = info.num_items if info.num_items is not None else hparams.get("num_items")
    if saved_items is not None and saved_items != num_items:
        raise ValueError(
            f"{source}: the checkpoint was trained on num_items={saved_items} items but the "
            f"data has {num_items}; use the data (and item ids) it was trained on, "
            "or encode the data in its vocabulary (the DataModule's item_vocabulary)"
        )
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if (missing or unexpected) and strict:
        raise ValueError(
            f"{source}: checkpoint from another model: missing parameters {missing[:4]}, "
            f"unexpected {unexpected[:4]} ({len(missing)} missing, "
            f"{len(unexpected)} unexpected)"
        )
    for name, tensor in state.items():
        if not isinstance(tensor, Tensor) or name not in own:
            continue
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(
                f"{source}: parameter {name} has shape {tuple(tensor.shape)} in the "
                f"checkpoint, {tuple(own[name].shape)} in this model (other options?)"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{source}: parameter {name} holds NaN or inf values")


def check_timestamps(dm: object, checkpoint: dict[str, Any], model: object, source: str) -> None:
    """Refuse data without timestamps for a model trained with them that reads them
    (HSTU's time bias): it would be evaluated or serve as another function."""
    timed = (read_record(checkpoint) or CheckpointRecord()).timestamps
    if not timed or not getattr(model, "uses_timestamps", False) or dm is None:
        return
    if getattr(dm, "has_time", None) is False:
        raise ValueError(
            f"{source}: its {type(model).__name__} was trained with timestamps (a learned "
            "time bias in its attention), but the data has none: give it the same data "
            "with its timestamp column"
        )
