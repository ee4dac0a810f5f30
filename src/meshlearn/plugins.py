"""The extension points: things registered by name (models, algorithms, aggregation rules).

Code registers them (meshlearn's own modules, or a local module its user or operator names);
a name in a configuration only selects one. Nothing is ever imported by a name that came from
the network.
"""

from __future__ import annotations

import importlib
import importlib.util
import shlex
from pathlib import Path
from typing import Callable, Generic, Mapping, TypeVar

from meshlearn.errors import ConfigError, MeshlearnError, UserInputError
from meshlearn.suggest import did_you_mean

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
            raise self.error(self.unknown(name))

    def unknown(self, name: str) -> str:
        """What to say of a ``name`` not registered: the known one it may have meant, and the rest."""
        return f"unknown {self.kind} {name!r}: {did_you_mean(name, self.names())}choose one of {', '.join(self.names())}"

    def get(self, name: str) -> T:
        """The extension named ``name``."""
        self.check(name)
        if name not in self._items:
            importlib.import_module(self._built_in[name])
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(set(self._items) | set(self._built_in))

    def extensions(self) -> list[str]:
        """The names registered by now that are not meshlearn's own (a user's module added them)."""
        return sorted(set(self._items) - set(self._built_in))

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


def load_folder_module(config_file: str | Path, asked: str | None, allowed: str | Path | None) -> None:
    """Run the models module that a configuration read from a results folder (``config_file``)
    names (``asked``), but only where its user named the same file (``allowed``: their
    ``--models-module``; the two compared as absolute paths, resolved from the current folder as
    the import would be): a results folder someone shares must not run code as whoever reads it.
    Where it names one that is not allowed, UserInputError (exit 2) in one line saying what it
    asks for and how to allow it; nothing where it names none."""
    if not asked:
        return
    wanted = Path(asked).expanduser().resolve()
    if allowed is None or Path(allowed).expanduser().resolve() != wanted:
        other = f" (--models-module {_shown(allowed)} is another file)" if allowed is not None else ""
        raise UserInputError(f"{_shown(config_file)} asks to import models module {_shown(wanted)}{other} (its code "
                             f"would run as you): give --models-module {_shown(wanted)} to allow it")
    load_user_module(wanted)


def _shown(path: str | Path) -> str:
    """A path as a shell would take it back, on one line (whatever a shared file put in it)."""
    text = shlex.quote(str(path))
    return text if text.isprintable() else ascii(str(path))
