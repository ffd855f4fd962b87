"""Config files checked before the parser reads them: one line naming the file.

jsonargparse reads a YAML config leniently: an empty file or one with only
comments is "Unexpected config:" with no name, a list is taken for options,
a key given twice keeps its last value silently, and an included file
(``model: model/x.yaml``) that is missing is reported as an "import path".
:func:`check_config_files` reads every config file a command line names, and
every file they include (relative to the including file, as the parser
resolves them), and refuses each of these with the file, the line and what
was expected.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["check_config_file", "check_config_files", "config_paths"]

_OPTIONS = ("--config", "-c", "--model", "--data", "--trainer", "--optimizer", "--lr_scheduler")


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:  # type: ignore[override]
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ValueError(
                    f"key {key!r} is given twice, on line {seen[key]} and line {line} (keep one)"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def config_paths(argv: Sequence[str]) -> list[str]:
    """The YAML files ``argv`` names as configs (``--config X``, ``--model X.yaml`` ...)."""
    found = []
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key not in _OPTIONS:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if key in ("--config", "-c") or value.endswith((".yaml", ".yml")):
            if value and not value.lstrip().startswith(("{", "[")):
                found.append(value)
    return found


def _includes(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for sub in value.values():
            yield from _includes(sub)
    elif isinstance(value, list):
        for sub in value:
            yield from _includes(sub)
    elif isinstance(value, str) and value.endswith((".yaml", ".yml")) and "\n" not in value:
        yield value


def check_config_file(path: str | Path, seen: set[Path] | None = None, by: str = "") -> None:
    """Refuse a config file that is missing, unreadable, not a mapping of options, has a
    key twice, or includes a missing file; the message names the file (and line)."""
    file = Path(path)
    seen = set() if seen is None else seen
    if file.resolve() in seen:
        return
    seen.add(file.resolve())
    if file.is_dir():
        raise ValueError(f"{by}{file}: is a directory, not a config file")
    if not file.is_file():
        raise FileNotFoundError(f"{by}config file not found: {file}")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = file.read_bytes()[: err.start].count(b"\n") + 1
        raise ValueError(f"{file}: line {line}: not UTF-8 text ({err.reason})") from None
    try:
        config = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None
    except yaml.YAMLError:
        return  # the command line's YAML report gives the line and column
    if config is None:
        raise ValueError(f"{file}: empty config (no options; only comments or blank lines)")
    if not isinstance(config, dict):
        raise ValueError(
            f"{file}: expected a mapping of options (key: value), got a {type(config).__name__}"
        )
    for include in _includes(config):
        target = Path(include) if Path(include).is_absolute() else file.parent / include
        if not target.exists():
            raise FileNotFoundError(
                f"{file}: includes {include}, which is missing (looked for {target})"
            )
        check_config_file(target, seen, by=f"{file}: includes ")


def check_config_files(argv: Sequence[str]) -> None:
    """:func:`check_config_file` for every config file named in ``argv``."""
    for path in config_paths(argv):
        check_config_file(path)
