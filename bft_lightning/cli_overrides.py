"""What the user stated wins over a checkpoint's saved hyperparameters.

With ``--ckpt_path``, ``LightningCLI`` re-applies the hyperparameters saved in
the checkpoint over the parsed command line and config (upstream Lightning
behaviour), so ``test --ckpt_path best.ckpt --model.init_args.mask_history=true``
would evaluate with the saved ``false``. :func:`keep_explicit` undoes that for
every model option the user stated explicitly, on the command line or in a
config file, and refuses the options that cannot change without invalidating
the weights (sizes, vocabulary, the backbone class), naming the option and both
values. Options the user did not state keep the checkpoint's values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "WEIGHT_OPTIONS",
    "explicit_model_options",
    "keep_explicit",
    "recorded_options",
    "stated_backbone_flags",
]

# options whose value is part of the weights' shape or meaning
WEIGHT_OPTIONS = frozenset({
    "class_path", "num_items", "max_len", "d_model", "nhead", "num_layers", "dim_feedforward",
    "groups", "prior", "prior_width", "head", "precision", "key_precision", "linear_dim",
    "num_buckets", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "hidden_size",
    "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "item_vocabulary",
})  # fmt: skip


def _norm(key: str) -> str:
    """``init_args.backbone.init_args.d_model`` -> ``backbone.d_model``."""
    return ".".join(p for p in key.split(".") if p not in ("init_args", "dict_kwargs"))


def _leaves(value: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _leaves(sub, f"{prefix}.{key}" if prefix else str(key))
    elif prefix:
        yield prefix


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None  # the parser reports unreadable files itself


def _model_keys(model: Any, base: Path, prefix: str = "") -> Iterator[str]:
    """Leaf keys of a ``model:`` value; a string naming a YAML file is read (relative to base)."""
    if isinstance(model, str) and model.endswith((".yaml", ".yml")):
        path = (base / model) if not Path(model).is_absolute() else Path(model)
        yield from _model_keys(_yaml(path), path.parent, prefix)
    elif isinstance(model, dict):
        for key, sub in model.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(sub, str) and sub.endswith((".yaml", ".yml")):
                yield from _model_keys(sub, base, name)
            elif isinstance(sub, dict):
                yield from _model_keys(sub, base, name)
            else:
                yield name
    elif isinstance(model, str) and prefix == "":
        yield "class_path"


def explicit_model_options(argv: Sequence[str]) -> set[str]:
    """The model options (normalised: ``backbone.d_model``) that ``argv`` states explicitly,
    on the command line (``--model.…``) or in a ``--config`` file's ``model:`` block."""
    found: set[str] = set()
    args = list(argv)
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if not eq and i + 1 < len(args):
            value = args[i + 1]
        if key in ("--config", "-c") and value:
            config = _yaml(Path(value))
            if isinstance(config, dict) and "model" in config:
                found.update(_model_keys(config["model"], Path(value).parent))
        elif key == "--model" and value:
            found.update(_model_keys(value, Path.cwd()))
        elif key.startswith("--model."):
            found.add(key.removeprefix("--model."))
    return {_norm(k) for k in found}


def stated_backbone_flags(argv: Sequence[str]) -> set[str]:
    """Flat backbone options given as command-line flags (``--model.init_args.backbone.
    init_args.precision=off`` -> ``precision``); not those of a ``--config`` file, whose
    resolved form (a ``best.yaml``) repeats every default."""
    prefix = "--model.init_args.backbone.init_args."
    out = set()
    for arg in argv:
        rest = arg.partition("=")[0].removeprefix(prefix)
        if arg.startswith(prefix) and rest and "." not in rest:
            out.add(rest)
    return out


def _flat(ns: Any, stated: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    items = ns.items(branches=False) if hasattr(ns, "items") else []
    return _effective({_norm(str(k)): (str(k), v) for k, v in items}, stated)


def _canonical(name: str) -> str:
    """A filter option under its flat name: ``backbone.filter.q_init`` -> ``backbone.q_init``."""
    return name.replace("backbone.filter.", "backbone.")


def _effective(flat: dict[str, Any], stated: set[str] | frozenset[str] = frozenset()) -> dict:
    """A backbone's filter options as the model receives them, under their flat names
    (``backbone.precision``): a flat option the user stated, or one that differs from
    its default, wins (as ``models.base.fold_flat_filter_options`` folds it); else the
    ``filter:`` block's."""
    from bft_lightning.models.base import FLAT_FILTER_DEFAULTS

    for name, default in FLAT_FILTER_DEFAULTS.items():
        key = f"backbone.{name}"
        mine, block = flat.get(key), flat.pop(f"backbone.filter.{name}", None)
        if name in stated and mine is not None:
            continue
        if block is not None and (mine is None or _same(mine[1], default)):
            flat[key] = block
    return flat


def recorded_options(record: Any) -> dict[str, Any]:
    """What a checkpoint's format record says the weights were built with (normalised
    names: ``backbone.d_model``, ``backbone.class_path``, ``num_items``, ``max_len``)."""
    if record is None:
        return {}
    out: dict[str, Any] = {}
    spec = record.backbone_init or {}
    if spec.get("class_path"):
        out["backbone.class_path"] = ("", spec["class_path"])
    init = spec.get("init_args") or {}
    for key, value in init.items():
        if key == "filter" and isinstance(value, dict):
            out.update({f"backbone.filter.{k}": ("", v) for k, v in value.items()})
        else:
            out[f"backbone.{key}"] = ("", value)
    return {name: value for name, (_, value) in _effective(out).items()}


def keep_explicit(
    before: Any,
    after: Any,
    explicit: set[str],
    source: str,
    recorded: dict[str, Any] | None = None,
    flags: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
    """Put the user's explicit values of ``before`` back into ``after`` (the model namespace
    after the checkpoint's hyperparameters were applied); returns the options restored.

    ``recorded``: what the checkpoint's record says the weights were built with
    (:func:`recorded_options`), checked too for the options in :data:`WEIGHT_OPTIONS`.
    ``flags``: flat backbone options given as flags (:func:`stated_backbone_flags`),
    which win over a ``filter:`` block even at their default.

    Raises:
        SystemExit: an explicit option in :data:`WEIGHT_OPTIONS` differs from the checkpoint.
    """
    old, new = _flat(before, flags), _flat(after)
    restored = []
    for name in sorted({_canonical(n) for n in explicit}):
        if name not in old:
            continue
        mine = old[name][1]
        weight = name.split(".")[-1] in WEIGHT_OPTIONS
        if weight and name in (recorded or {}) and not _same(mine, (recorded or {})[name]):
            _refuse(name, mine, (recorded or {})[name], source)
        if name not in new:
            continue
        key, saved = new[name]
        if _same(mine, saved):
            continue
        if weight:
            _refuse(name, mine, saved, source)
        after[key] = mine
        restored.append(name)
    return restored


def _refuse(name: str, mine: Any, saved: Any, source: str) -> None:
    raise SystemExit(
        f"error: --model.{name}: {mine!r} given, but the checkpoint {source} was trained with "
        f"{saved!r}; this option cannot change without invalidating its weights (drop it, or "
        "train a new model)"
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return list(a) == list(b)
    if isinstance(a, str) and isinstance(b, str) and a != b and "." in a and "." in b:
        return _import(a) is not None and _import(a) is _import(b)  # two paths, one class
    return bool(a == b)


def _import(class_path: str) -> object:
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except (ImportError, ValueError):
        return None
