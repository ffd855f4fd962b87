"""The search space: a YAML file of CLI option paths and the values each may take.

One parameter per top-level key; the key is the option's dotted path as ``fit``
takes it (``model.init_args.lr``), the value one of::

    model.init_args.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
    model.init_args.backbone.init_args.num_layers: {type: int, low: 1, high: 4}
    model.init_args.loss: {type: categorical, choices: [ce, sampled_softmax_logq]}
    model.init_args.weight_decay: 0.0            # fixed (or {type: fixed, value: 0.0})
    model.init_args.num_negatives:               # sampled only when the condition holds
      {type: int, low: 32, high: 512, log: true, when: {model.init_args.loss: sampled_softmax_logq}}

``float`` and ``int`` take ``low``, ``high`` and optionally ``log`` or ``step``;
``when`` maps earlier parameters to a value (or a list of accepted values).
``extends: other.yaml`` (relative to this file) starts from that space: its
parameters first, in order; a key given again here replaces the inherited one.

Every error names the file, the line and the key (:class:`SearchSpaceError`, a
``ValueError``: the command line prints it on one line and exits with status 2).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Param", "SearchSpace", "SearchSpaceError", "load_space", "to_override"]

TYPES = ("float", "int", "categorical", "fixed")
_KEYS = {
    "float": {"type", "low", "high", "log", "step", "when"},
    "int": {"type", "low", "high", "log", "step", "when"},
    "categorical": {"type", "choices", "when"},
    "fixed": {"type", "value", "when"},
}


class SearchSpaceError(ValueError):
    """A search-space file that cannot be used, located: ``FILE: line N: KEY: what``."""


class _Mapping(dict):
    """A YAML mapping that remembers the line of each key."""

    lines: dict[Any, int]


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Mapping:
    loader.flatten_mapping(node)
    out = _Mapping()
    out.lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in out:
            raise SearchSpaceError(
                f"{loader.name}: line {line}: {key}: given twice (first at line {out.lines[key]})"
            )
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = line
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass(frozen=True)
class Param:
    """One option of the space, where it was written, and how it is drawn."""

    key: str
    kind: str  # float | int | categorical | fixed
    file: str
    line: int
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()
    value: Any = None
    when: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def where(self) -> str:
        return f"{self.file}: line {self.line}: {self.key}"

    def probe_values(self) -> list[Any]:
        """Values that exercise the option's type in a parse: the ends, or every choice."""
        if self.kind == "fixed":
            return [self.value]
        if self.kind == "categorical":
            return list(self.choices)
        return [self.low, self.high]

    def possible(self) -> tuple[Any, ...] | None:
        """The values a condition on this parameter can meet (None: a range)."""
        if self.kind == "fixed":
            return (self.value,)
        if self.kind == "categorical":
            return self.choices
        return None

    def spec(self) -> dict[str, Any]:
        """A plain description (the study's fingerprint, the docs' tables)."""
        out: dict[str, Any] = {"type": self.kind}
        if self.kind in ("float", "int"):
            out.update(low=self.low, high=self.high, log=self.log, step=self.step)
        elif self.kind == "categorical":
            out["choices"] = list(self.choices)
        else:
            out["value"] = self.value
        if self.when:
            out["when"] = {k: list(v) for k, v in self.when.items()}
        return out


@dataclass(frozen=True)
class SearchSpace:
    """The parameters of a search-space file (``extends`` resolved), in order."""

    path: str
    params: tuple[Param, ...]

    def searched(self) -> list[Param]:
        return [p for p in self.params if p.kind != "fixed"]

    def fingerprint(self) -> str:
        text = json.dumps([[p.key, p.spec()] for p in self.params], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def sample(self, trial: Any) -> dict[str, Any]:
        """Draw one assignment through an Optuna trial: the parameters whose ``when``
        holds, fixed ones included (Optuna records the searched ones only)."""
        chosen: dict[str, Any] = {}
        for p in self.params:
            if any(chosen.get(k, _MISSING) not in ok for k, ok in p.when.items()):
                continue
            if p.kind == "fixed":
                chosen[p.key] = p.value
            elif p.kind == "categorical":
                chosen[p.key] = trial.suggest_categorical(p.key, list(p.choices))
            elif p.kind == "float":
                chosen[p.key] = trial.suggest_float(
                    p.key, float(p.low), float(p.high), log=p.log,  # type: ignore[arg-type]
                    step=None if p.step is None else float(p.step),
                )  # fmt: skip
            else:
                chosen[p.key] = trial.suggest_int(
                    p.key, int(p.low), int(p.high), log=p.log,  # type: ignore[arg-type]
                    step=1 if p.step is None else int(p.step),
                )  # fmt: skip
        return chosen

    def overrides(self, values: dict[str, Any]) -> list[str]:
        return [to_override(k, v) for k, v in values.items()]


_MISSING = object()


def to_override(key: str, value: Any) -> str:
    """``--key=value`` as the CLI reads it (numbers and booleans as JSON).

    A null is passed as an inline ``--config`` document: jsonargparse reads
    ``--a.init_args.b=null`` on a nested class's option as the string "None"."""
    if value is None:
        nested: Any = None
        for part in reversed(key.split(".")):
            nested = {part: nested}
        return f"--config={json.dumps(nested)}"
    if isinstance(value, str):
        return f"--{key}={value}"
    return f"--{key}={json.dumps(value)}"


def load_space(path: str | Path, _seen: tuple[str, ...] = ()) -> SearchSpace:
    """Read and check a search-space file (and the files it extends)."""
    path = Path(path)
    name = str(path)
    if not path.is_file():
        raise SearchSpaceError(f"--search {name}: file not found")
    if str(path.resolve()) in _seen:
        raise SearchSpaceError(f"{name}: extends itself (through {' -> '.join(_seen)})")
    try:
        loader = _Loader(path.read_text(encoding="utf-8"))
        loader.name = name
        try:
            doc = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = getattr(err, "problem", None) or str(err).splitlines()[0]
        problem = f"{name}: {where}invalid YAML ({what})"
    else:
        problem = ""
    if problem:  # raised outside the handler: the message is this one
        raise SearchSpaceError(problem)
    if doc is None:
        raise SearchSpaceError(f"{name}: empty search space (no parameter to search)")
    if not isinstance(doc, _Mapping):
        raise SearchSpaceError(f"{name}: line 1: a search space is a mapping of option paths")
    params: dict[str, Param] = {}
    if "extends" in doc:
        parent = doc["extends"]
        if not isinstance(parent, str):
            raise SearchSpaceError(f"{name}: line {doc.lines['extends']}: extends: a file name")
        base = load_space(path.parent / parent, (*_seen, str(path.resolve())))
        params = {p.key: p for p in base.params}
    for key, raw in doc.items():
        if key == "extends":
            continue
        params[str(key)] = _param(str(key), raw, name, doc.lines[key])
    space = SearchSpace(name, tuple(params.values()))
    _check_conditions(space)
    if not space.searched():
        raise SearchSpaceError(f"{name}: no parameter to search (every value is fixed)")
    return space


def _param(key: str, raw: Any, file: str, line: int) -> Param:
    def bad(what: str) -> SearchSpaceError:
        return SearchSpaceError(f"{file}: line {line}: {key}: {what}")

    if not key.replace("_", "").replace(".", "").replace("@", "").isalnum() or key.startswith("-"):
        raise bad("a key is a dotted option path, e.g. model.init_args.lr")
    if not isinstance(raw, dict):
        if isinstance(raw, list):
            raise bad("a list: write {type: categorical, choices: [...]} to search it")
        return Param(key, "fixed", file, line, value=raw)
    kind = raw.get("type")
    if kind not in TYPES:
        raise bad(f"type must be one of {', '.join(TYPES)}, got {kind!r}")
    unknown = sorted(set(raw) - _KEYS[kind])
    if unknown:
        raise bad(f"unknown field(s) {', '.join(map(str, unknown))} for type {kind}")
    when = _when(raw.get("when"), bad)
    if kind == "fixed":
        if "value" not in raw:
            raise bad("type fixed needs a value")
        return Param(key, kind, file, line, value=raw["value"], when=when)
    if kind == "categorical":
        choices = raw.get("choices")
        if not isinstance(choices, list) or not choices:
            raise bad("choices must be a non-empty list")
        for c in choices:
            if c is not None and not isinstance(c, bool | int | float | str):
                raise bad(f"choice {c!r}: a choice is a number, a string, true/false or null")
        return Param(key, kind, file, line, choices=tuple(choices), when=when)
    number = float if kind == "float" else int
    values = {}
    for name in ("low", "high", "step"):
        if name not in raw or (name == "step" and raw[name] is None):
            if name != "step":
                raise bad(f"type {kind} needs low and high")
            continue
        value = raw[name]
        converted = _number(number, value)  # YAML reads 1e-4 (no dot) as a string
        if converted is None:
            raise bad(f"{name} must be a{'n' if kind == 'int' else ''} {kind}, got {value!r}")
        values[name] = converted
        if kind == "float" and not math.isfinite(values[name]):
            raise bad(f"{name} must be finite, got {value!r}")
    low, high, step = values["low"], values["high"], values.get("step")
    log = raw.get("log", False)
    if not isinstance(log, bool):
        raise bad(f"log must be true or false, got {log!r}")
    if low > high:
        raise bad(f"low ({low}) is above high ({high})")
    if log and low <= 0:
        raise bad(f"log needs low > 0, got {low}")
    if log and step is not None:
        raise bad("log and step do not go together")
    if step is not None and step <= 0:
        raise bad(f"step must be > 0, got {step}")
    return Param(key, kind, file, line, low=low, high=high, log=log, step=step, when=when)


def _number(number: type, value: Any) -> float | int | None:
    if isinstance(value, bool) or (number is int and isinstance(value, float)):
        return None
    try:
        return number(value)
    except (TypeError, ValueError):
        return None


def _when(raw: Any, bad: Any) -> dict[str, tuple[Any, ...]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise bad("when maps an earlier parameter to a value, e.g. {model.init_args.loss: bce}")
    return {str(k): tuple(v) if isinstance(v, list) else (v,) for k, v in raw.items()}


def _check_conditions(space: SearchSpace) -> None:
    """Each ``when`` names an earlier parameter and values that it can take."""
    earlier: dict[str, Param] = {}
    for p in space.params:
        for key, accepted in p.when.items():
            if key == p.key:
                raise SearchSpaceError(f"{p.where()}: when: a parameter cannot depend on itself")
            cond = earlier.get(key)
            if cond is None:
                later = any(q.key == key for q in space.params)
                raise SearchSpaceError(
                    f"{p.where()}: when: {key} is "
                    + ("defined after it; move it up" if later else "not a parameter of the space")
                )
            possible = cond.possible()
            if possible is None:
                raise SearchSpaceError(
                    f"{p.where()}: when: {key} is a range; a condition needs a categorical "
                    "or fixed parameter"
                )
            never = [v for v in accepted if v not in possible]
            if never:
                raise SearchSpaceError(
                    f"{p.where()}: when: {key} never takes {never[0]!r} "
                    f"(its values: {', '.join(map(repr, possible))})"
                )
        earlier[p.key] = p
