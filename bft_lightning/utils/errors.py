"""One line for a bad input: what the command line prints instead of a traceback.

:func:`run_with_clear_errors` runs a command-line function. A bad input (a
config or CLI value, a data file, a checkpoint) surfaces as a ``ValueError``,
``FileNotFoundError``, a jsonargparse ``ArgumentError`` or a ``SystemExit``
carrying a message: it is printed as ``error: <message>`` on one line of
stderr and the process exits
with code 2. Everything else (a bug, out of memory) keeps its traceback. With
``--debug`` anywhere on the command line, or ``BFT_DEBUG=1`` in the
environment, nothing is caught: the full traceback is shown.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["EXIT_BAD_INPUT", "debug_requested", "one_line", "run_with_clear_errors"]

EXIT_BAD_INPUT = 2

_INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)


def debug_requested(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """(``--debug`` given or ``BFT_DEBUG`` set, argv without ``--debug``)."""
    rest = [a for a in argv if a != "--debug"]
    env = os.environ.get("BFT_DEBUG", "").strip().lower() not in ("", "0", "false", "no")
    return env or len(rest) != len(argv), rest


def _argument_error() -> type[BaseException] | None:
    try:
        from jsonargparse import ArgumentError
    except ImportError:  # pragma: no cover - jsonargparse comes with the CLI extra
        return None
    return ArgumentError


def condense_parser_message(message: str) -> str:
    """jsonargparse's nested report -> ``--a.init_args.b: <what is wrong>``.

    The report nests one ``Parser key "k":`` block per level and lists every
    Union alternative that failed (``Expected a <class 'NoneType'>``, the given
    value's repr). The line kept is the deepest real complaint, prefixed with
    the option it is about.
    """
    lines = []
    for line in message.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        head, *nested = re.split(r':\s+(?=Parser key ")', line)
        lines.append(head if not nested else head + ":")
        lines += [" " * (indent + k + 1) + part for k, part in enumerate(nested)]
    given = [
        line.strip().removeprefix("Given value: ")
        for line in lines
        if line.strip().startswith("Given value: ")
        and not re.match(r"Given value: (NestedArg|Namespace)\(", line.strip())
    ]
    keys: list[tuple[int, str]] = []  # (indent, key) of the path to the deepest block
    deepest: tuple[list[str], str] | None = None
    noise = re.compile(
        r"^(- )?(Does not validate against|Subtypes:|Errors:|Given value|"
        r"Expected a <class 'NoneType'>|Problem with given class_path|Not a valid subclass)"
    )
    for line in lines:
        indent = len(line) - len(line.lstrip())
        text = line.strip()
        match = re.match(r'^(?:- )?(?:error: )?Parser key "([^"]+)":?\s*(.*)$', text)
        if match:
            while keys and keys[-1][0] >= indent:
                keys.pop()
            keys.append((indent, match.group(1)))
            if match.group(2):
                deepest = ([k for _, k in keys], match.group(2))
            continue
        if noise.match(text) or not keys:
            continue
        while keys and keys[-1][0] >= indent:
            keys.pop()
        if keys and (deepest is None or len(keys) >= len(deepest[0])):
            deepest = ([k for _, k in keys], text.removeprefix("- "))
    if deepest is None:
        text = "; ".join(line.strip() for line in lines) or "invalid arguments"
        return text.replace(' in "<unicode string>",', "").removeprefix("error: ")
    path, what = deepest
    first, sep, rest = what.partition(". Got value: ")
    if sep:
        what = first + sep + rest.split(". Got value: ")[0]
    elif given and "Got value" not in what:
        what = f"{what}. Got value: {given[-1]}"
    option = "--" + ".init_args.".join(path) if len(path) > 1 else "--" + path[0]
    return f"{option}: {what}"


def _innermost(err: BaseException) -> BaseException:
    """The deepest bad-input exception of ``err``'s cause/context chain."""
    found, seen = err, set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        bare = isinstance(current, UnicodeError) and current is not err  # a decoder's own
        if (
            isinstance(current, _INPUT_ERRORS)
            and type(current).__module__.split(".")[0] != "jsonargparse"
            and not bare  # message: the error raised from it names the file and line
        ):
            found = current
        context = None if current.__suppress_context__ else current.__context__
        current = current.__cause__ or context  # `raise ... from None` hides its context
    return found


def one_line(err: BaseException) -> str:
    """The message of a bad-input error, on one line, without the ``error:`` prefix."""
    argument_error = _argument_error()
    if argument_error is not None and isinstance(err, argument_error):
        return condense_parser_message(str(err))
    inner = _innermost(err)
    if isinstance(inner, OSError) and inner.filename is not None and inner.strerror:
        text = f"{inner.filename}: {inner.strerror}"
    else:
        text = str(inner) or type(inner).__name__
    if "Parser key" in text:
        return condense_parser_message(text)
    parts = [p.strip() for p in text.splitlines() if p.strip()]
    return "; ".join(parts).removeprefix("error: ")


def _fail(message: str) -> int:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return EXIT_BAD_INPUT


def yaml_problem(argv: Sequence[str]) -> str | None:
    """The first YAML file named on the command line that does not parse, with its line."""
    import yaml

    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
        if not value.endswith((".yaml", ".yml")) or not os.path.isfile(value):
            continue
        try:
            yaml.safe_load(open(value, encoding="utf-8").read())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            what = getattr(err, "problem", None) or str(err).splitlines()[0]
            context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
            if context and start is not None:
                what += f", {context} that starts at line {start.line + 1}"
            return f"{value}: {where}invalid YAML ({what})"
    return None


def run_with_clear_errors(func: Callable[[list[str]], Any], argv: Sequence[str]) -> int:
    """``func(argv without --debug)``; returns the exit code (0, or 2 for a bad input)."""
    debug, rest = debug_requested(argv)
    if debug:
        func(rest)
        return 0
    argument_error = _argument_error()
    caught = _INPUT_ERRORS + ((argument_error,) if argument_error is not None else ())
    try:
        func(rest)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            raise  # --help (0) or a parser that already printed its own message
        return _fail(" ".join(str(stop.code).split()).removeprefix("error: "))
    except caught as err:
        message = one_line(err)
        if message.startswith("Problems parsing config"):
            message = yaml_problem(rest) or message
        return _fail(message)
    except Exception as err:  # a bad input wrapped by a library (jsonargparse, Lightning)
        inner = _innermost(err)
        if inner is err:
            raise
        return _fail(one_line(inner))
    return 0
