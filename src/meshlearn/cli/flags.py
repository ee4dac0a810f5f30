"""Command-line flags made from settings models: name, type, choices, help and default come from
the model's fields, so a default lives in one place and every flag's help says what it does."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Iterable, Mapping

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


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
