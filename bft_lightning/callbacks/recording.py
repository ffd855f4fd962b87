"""Which filter layers a callback watches, and recording shared between callbacks.

Layers are found in any model by the ``FilterRecorder`` protocol
(``bft_lightning.nn.find_filter_layers``), so a callback needs no knowledge of
the model's classes. Several callbacks may want the same layer recorded on the
same batch (say a ``PrecisionMonitor`` and an ``AttentionSinkMonitor`` on
validation); ``acquire`` / ``release`` count the requests per layer, so one
callback switching recording off never takes the statistics from another.
Recording (and attention recording) stays on while any request holds it; the
last release restores what the layer had before (so a user's own
``set_recording(model, True)`` survives).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from fnmatch import fnmatchcase

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.data import DistributedSampler

from bft_lightning.nn.stats import FilterRecorder, FilterStats, find_filter_layers

Layers = list[tuple[str, FilterRecorder]]

# layer -> {id(owner): wants attention}; layer -> (record, record_attention) before the first
_REQUESTS: weakref.WeakKeyDictionary[object, dict[int, bool]] = weakref.WeakKeyDictionary()
_BEFORE: weakref.WeakKeyDictionary[object, tuple[bool, bool]] = weakref.WeakKeyDictionary()


def select_layers(
    model: nn.Module, patterns: Sequence[str | int] | None, who: str, warn: bool = True
) -> Layers:
    """The filter layers of ``model`` named by ``patterns``, in module order.

    A pattern is a glob on the module name (``"encoder.layers.*"``) or an
    index into the found layers (``0``, ``-1``; ``-count`` .. ``count - 1``).
    None selects every layer. With ``warn``, warns when nothing matches.

    Raises:
        ValueError: an index outside the found layers (checked only once some
            are found: a model may build its layers after the callback's setup).
    """
    found = list(find_filter_layers(model))
    if patterns is None:
        chosen = found
    else:
        for p in patterns:
            _check_index(p, len(found), who)
        chosen = [
            (name, layer)
            for i, (name, layer) in enumerate(found)
            if any(_matches(p, name, i, len(found)) for p in patterns)
        ]
    if not chosen and warn:
        rank_zero_warn(
            f"{who}: found no BFT layer (no module with `record`, `record_attention` and "
            f"`last_stats`) matching layers={patterns!r} in {type(model).__name__}; "
            "it will log nothing."
        )
    return chosen


def _index(pattern: str | int) -> int | None:
    if isinstance(pattern, int):
        return pattern
    return int(pattern) if pattern.lstrip("-").isdigit() else None


def _check_index(pattern: str | int, count: int, who: str) -> None:
    index = _index(pattern)
    if index is not None and count and not -count <= index < count:
        raise ValueError(
            f"{who}: layers index {pattern!r} is out of range: the model has {count} BFT "
            f"layers (indices {-count}..{count - 1})"
        )


def _matches(pattern: str | int, name: str, index: int, count: int) -> bool:
    i = _index(pattern)
    if i is not None:
        return i % count == index if count else False
    return fnmatchcase(name, str(pattern))


def acquire(layers: Layers, owner: object, attention: bool | str = False) -> None:
    """Switch recording on in ``layers`` on behalf of ``owner``.

    ``attention``: True records the attention weights too; ``"off"`` only in
    layers with ``precision="off"``, which compute ``n_eff`` only from them
    (BFT layers compute it anyway, without holding a (B, H, T, T) tensor).
    """
    for _, layer in layers:
        wants = attention is True or (attention == "off" and is_plain(layer))
        requests = _REQUESTS.setdefault(layer, {})
        if not requests:
            _BEFORE[layer] = (layer.record, layer.record_attention)
        requests[id(owner)] = wants
        layer.record = True
        layer.record_attention = layer.record_attention or wants
        # every position's statistics: no last-position-only evaluation (models.base)
        setattr(layer, "record_all_positions", True)  # noqa: B010 - FilterLayer's flag


def is_plain(layer: FilterRecorder) -> bool:
    """Whether ``layer`` runs with ``precision="off"`` (no filter: its gain is 1)."""
    return getattr(layer, "precision", None) == "off"


def release(layers: Layers, owner: object) -> None:
    """Drop ``owner``'s request. The last one out restores the layer's own setting (off,
    unless the user switched recording on) and, when that is off, clears ``last_stats``."""
    for _, layer in layers:
        requests = _REQUESTS.get(layer)
        if not requests or requests.pop(id(owner), None) is None:
            continue
        record, attention = _BEFORE.get(layer, (False, False))
        if requests:
            layer.record_attention = attention or any(requests.values())
            continue
        _BEFORE.pop(layer, None)
        layer.record, layer.record_attention = record, attention
        setattr(layer, "record_all_positions", False)  # noqa: B010
        if not record:
            layer.last_stats = None


def read_stats(layers: Layers) -> list[FilterStats | None]:
    """The ``last_stats`` of each layer (None where a layer did not run)."""
    return [layer.last_stats for _, layer in layers]


def _eval_sampler(trainer: Trainer, stage: str, dataloader_idx: int) -> object | None:
    """The sampler of the running evaluation's dataloader ``dataloader_idx`` when that
    loader batches single samples (one sample, one row), else None."""
    loaders = trainer.val_dataloaders if stage == "validate" else trainer.test_dataloaders
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[dataloader_idx] if dataloader_idx < len(loaders) else None
    if getattr(loaders, "batch_size", None) is None:  # its items may be whole batches
        return None
    batch_sampler = getattr(loaders, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None)
    return sampler if sampler is not None else getattr(loaders, "sampler", None)


def real_rows(trainer: Trainer, stage: str, dataloader_idx: int = 0) -> int | None:
    """How many of this rank's evaluation samples are not ``DistributedSampler`` padding.

    Under DDP, Lightning gives rank ``r`` of ``W`` the positions ``r, r + W, ...``
    of the (possibly shuffled) sample list, padded at its end with repeats of
    its first samples until every rank has as many (``DistributedSampler`` and
    Lightning's ``DistributedSamplerWrapper``, ``drop_last=False``): position
    ``r + j W`` is a repeat when it is past the dataset's length. Returns None
    when nothing is repeated, the sampler is another one (whose layout is
    unknown), or the loader has no ``batch_size`` (its items may be whole
    batches, not rows): then every row counts.
    """
    sampler = _eval_sampler(trainer, stage, dataloader_idx)
    if type(sampler) not in (DistributedSampler, DistributedSamplerWrapper):
        return None
    assert isinstance(sampler, DistributedSampler)
    if sampler.drop_last:
        return None
    n = len(sampler.dataset)  # type: ignore[arg-type]
    real = len(range(sampler.rank, n, sampler.num_replicas))
    return real if real < sampler.num_samples else None


class PaddingRows:
    """Leaves out the rows of evaluation batches that ``DistributedSampler`` padding
    repeats (:func:`real_rows`), so that a DDP run measures every sample once, as
    one process does.

    The rows are counted per dataloader on the statistics' batch dimension
    (the rows of the layer's last forward), in the order the batches come; the
    repeats are the last rows of a rank's last batches, whose ``valid`` is
    cleared (every callback leaves invalid positions out). Call :meth:`reset`
    at each evaluation epoch start and :meth:`mask` on every batch's statistics
    in order.
    """

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}

    def reset(self) -> None:
        self._seen = {}

    def mask(
        self, trainer: Trainer, stage: str, dataloader_idx: int, stats: Sequence[FilterStats | None]
    ) -> list[FilterStats | None]:
        rows = next((s.valid.shape[0] for s in stats if s is not None), None)
        if rows is None:
            return list(stats)
        seen = self._seen.get(dataloader_idx, 0)
        self._seen[dataloader_idx] = seen + rows
        real = real_rows(trainer, stage, dataloader_idx)
        if real is None or seen + rows <= real:
            return list(stats)
        keep = torch.arange(rows) < max(0, real - seen)  # (B,): the rows that are not repeats
        return [
            None if s is None else replace(s, valid=s.valid & keep.to(s.valid.device).unsqueeze(1))
            for s in stats
        ]
