"""Package exports imported on first use, so a light module of a package (its settings, the wire's
HMAC) loads without the heavy ones (torch, ZeroMQ) that its siblings need."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: name -> the submodule that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__
