"""The extension points: things registered by name (models, algorithms, aggregation rules).

Code registers them (meshlearn's own modules, or a local module its user or operator names);
a name in a configuration only selects one. Nothing is ever imported by a name that came from
the network.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from meshlearn.errors import ConfigError, MeshlearnError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named extensions of one kind; an unknown name is one clear error listing the known ones."""

    def __init__(self, kind: str, error: type[MeshlearnError] = ConfigError):
        self.kind = kind
        self.error = error
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        """Register ``item`` under ``name`` (a later one replaces an earlier one)."""
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of ``add``."""
        return lambda item: self.add(name, item)

    def get(self, name: str) -> T:
        """The extension named ``name``."""
        if name not in self._items:
            raise self.error(f"unknown {self.kind} {name!r}: choose one of {', '.join(self.names())}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
