"""The extension points: things registered by name (models, algorithms, aggregation rules).

Code registers them (meshlearn's own modules, or a local module its user or operator names);
a name in a configuration only selects one. Nothing is ever imported by a name that came from
the network.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Callable, Generic, Mapping, TypeVar

from meshlearn.errors import ConfigError, MeshlearnError, UserInputError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named extensions of one kind; an unknown name is one clear error listing the known ones.

    ``built_in`` names meshlearn's own extensions and the module that registers each; a module is
    imported when one of its names is first used, so a name can be checked before torch loads.
    """

    def __init__(self, kind: str, error: type[MeshlearnError] = ConfigError, built_in: Mapping[str, str] | None = None):
        self.kind = kind
        self.error = error
        self._items: dict[str, T] = {}
        self._built_in = dict(built_in or {})

    def add(self, name: str, item: T) -> T:
        """Register ``item`` under ``name`` (a later one replaces an earlier one)."""
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of ``add``."""
        return lambda item: self.add(name, item)

    def check(self, name: str) -> None:
        """Raise the registry's error if ``name`` is unknown (imports nothing)."""
        if name not in self:
            raise self.error(f"unknown {self.kind} {name!r}: choose one of {', '.join(self.names())}")

    def get(self, name: str) -> T:
        """The extension named ``name``."""
        self.check(name)
        if name not in self._items:
            importlib.import_module(self._built_in[name])
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(set(self._items) | set(self._built_in))

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._built_in


_LOADED: dict[Path, object] = {}


def load_user_module(path: str | Path) -> None:
    """Run a local .py file that registers custom models and datasets (``register_model``,
    ``register_dataset``): only one its user names on the command line or in a config file, never
    one named over the network. Loading the same file twice runs it once."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserInputError(f"models module {file} does not exist: give a local .py file that registers "
                             "models or datasets")
    key = file.resolve()
    if key in _LOADED:
        return
    spec = importlib.util.spec_from_file_location(f"meshlearn_user_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's own file: say where it fails, in one line
        where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else ""
        raise UserInputError(f"models module {file} failed to load{where}: {type(exc).__name__}: {exc}") from None
    _LOADED[key] = module
