"""Command-line flags made from settings models: name, type, choices, help and default come from
the model's fields, so a default lives in one place and every flag's help says what it does."""

from __future__ import annotations

import argparse
import re
import shlex
import types
import typing
from typing import Any, Iterable, Mapping, Sequence

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

DEFAULT = re.compile(r"\s*\(default: ([^()]*(?:\([^()]*\)[^()]*)*)\)\s*$")  # how a flag's help ends
BRIEF_CHARS = 240  # a common flag's help longer than this shows without its asides in a short --help


def _kind(annotation: Any) -> tuple[type, list[str] | None]:
    """The argparse type and choices for a field's annotation (``str | None`` -> str)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _kind(args[0])
        return str, None  # e.g. int | Literal["epoch"]: the model validates the text
    if typing.get_origin(annotation) is typing.Literal:
        return str, [str(a) for a in typing.get_args(annotation)]
    if annotation is bool:
        return _true_or_false, ["true", "false"]  # parsed by the model
    return (annotation, None) if annotation in (int, float, str) else (str, None)


def _true_or_false(text: str) -> str:
    return text.lower()


def add_flags(group: argparse._ActionsContainer, fields: Iterable[tuple[str, FieldInfo]],
              types_: Mapping[str, type] | None = None, flag_names: Mapping[str, str] | None = None) -> None:
    """One ``--flag`` per (name, field); its value lands in ``args.<name>`` (None when not given,
    so the model's default applies). ``types_`` overrides a flag's type, ``flag_names`` its name."""
    for name, field in fields:
        kind, choices = _kind(field.annotation)
        kind = (types_ or {}).get(name, kind)
        default = None if field.default is PydanticUndefined else field.default
        if hasattr(default, "model_dump"):
            default = default.model_dump() or None
        if field.annotation is bool:
            default = str(default).lower()
        text = field.description or name.replace("_", " ")
        if default not in (None, "", [], {}):
            text += f" (default: {default})"
        elif "default" not in text:
            text += " (default: none)"
        flag = (flag_names or {}).get(name, name).replace("_", "-")
        extra = {"nargs": "?", "const": "true"} if field.annotation is bool else {}  # --flag alone: true
        group.add_argument(f"--{flag}", dest=name, type=kind, default=None, choices=choices,
                           metavar=None if choices else flag.upper().replace("-", "_"),
                           help=text.replace("%", "%%"), **extra)


def given(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The flags among ``names`` that were given on the command line."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def brief(text: str) -> str:
    """A flag's help as a short --help shows it: where longer than ``BRIEF_CHARS``, without its
    asides (what it says in parentheses), but with its default."""
    if len(text) <= BRIEF_CHARS:
        return text
    found = DEFAULT.search(text)
    meaning, default = (text[:found.start()], found.group(0)) if found else (text, "")
    kept, depth = [], 0
    for char in meaning:
        depth += char == "("
        if not depth:
            kept.append(char)
        depth -= char == ")" and depth > 0
    return re.sub(r"\s+([;,])", r"\1", " ".join("".join(kept).split())) + default


def as_typed(exc: Exception, parser: argparse.ArgumentParser, words: Sequence[str]) -> str:
    """The line that says ``exc``: an error about a setting the user gave as one of ``parser``'s flags
    opens with that flag and its value as typed (``--partition shards:abc: K must be ...``), the one
    place that prefix is written; any other error as it reads (a setting from a config file is named
    by its key)."""
    setting = getattr(exc, "setting", None)
    flags = next((action.option_strings for action in parser._actions
                  if setting and action.dest == setting and action.option_strings), [])
    typed = typed_value(flags, words)
    return str(exc) if typed is None else f"{flags[-1]} {shlex.quote(typed)}: {exc.problem}"


def typed_value(flags: Sequence[str], words: Sequence[str]) -> str | None:
    """The value last given to any of ``flags`` among the command line's ``words`` (``--lr 0.1`` or
    ``--lr=0.1``: argparse keeps the last), or None where none was."""
    found = None
    for index, word in enumerate(words):
        if word == "--":
            break
        name, eq, value = word.partition("=")
        if name in flags:
            found = value if eq else (words[index + 1] if index + 1 < len(words) else None)
    return found
