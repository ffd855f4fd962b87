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
from collections.abc import Sequence
from fnmatch import fnmatchcase

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

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
        if not record:
            layer.last_stats = None


def read_stats(layers: Layers) -> list[FilterStats | None]:
    """The ``last_stats`` of each layer (None where a layer did not run)."""
    return [layer.last_stats for _, layer in layers]
