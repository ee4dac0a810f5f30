"""The base of every component's typed settings, and one clear line for any invalid value.

Each component (a transport, an algorithm, the network emulation, a network service) owns a
``Settings`` subclass that holds its knobs, their defaults and their documentation in one place.
Larger configurations (an experiment, a dpwa adapter group, a network task) compose them.
Constructing any of them with a bad value raises ``ConfigError`` with one line that names the
setting, never a pydantic traceback.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, ClassVar, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from meshlearn.errors import ConfigError


def setting_error(exc: ValidationError, rename: Callable[[tuple], str] | None = None) -> ConfigError:
    """One line naming the first invalid setting, what is wrong, and what was given: a ConfigError
    whose ``setting`` and ``value`` say which (``udp_mode 'fast': Input should be ...``).

    ``rename`` turns an error location into the name the user wrote (e.g. ``udp.mode`` ->
    ``udp_mode`` when settings were given flat); by default the location is dotted.
    """
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not isinstance(p, int) or len(err["loc"]) == 1)
    where = (rename(loc) if rename and loc else ".".join(str(p) for p in loc)) or "config"
    extra = "" if len(exc.errors()) == 1 else f" (and {len(exc.errors()) - 1} more problem(s))"
    if err["type"] == "extra_forbidden":
        return ConfigError(f"unknown setting {where!r}: remove it or check its spelling{extra}")
    message = err["msg"].removeprefix("Value error, ")
    if not loc:  # a rule across settings
        return ConfigError(message + extra)
    return ConfigError(message + extra, setting=where, value=err.get("input"))


MAX_SEED = 2**32 - 1  # every seed a run takes: fits numpy's, torch's and Python's generators with room for offsets

class Settings(BaseModel):
    """Immutable, validated settings; unknown keys are refused. Bad values raise ConfigError."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # Where a composed configuration is written flat (an experiment file, a CLI flag), a field may
    # go by a longer name there: UdpSettings.mode is ``udp_mode``. Fields not listed keep their name.
    FLAT_NAMES: ClassVar[dict[str, str]] = {}

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise setting_error(exc, rename=self.setting_name) from None

    # Tell pydantic this __init__ only wraps BaseModel's: settings nested in other settings are then
    # validated as part of their parent, so one error names the whole path (udp.mode), not a part.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def setting_name(cls, loc: tuple) -> str:
        """What to call the setting at an error location in a one-line error (dotted by default)."""
        return ".".join(str(p) for p in loc)

    @classmethod
    def flat_names(cls) -> dict[str, str]:
        """Flat name -> field name, for every field."""
        return {cls.FLAT_NAMES.get(name, name): name for name in cls.model_fields}

    def fields_of(self, part: type["Settings"]) -> dict[str, Any]:
        """This object's values of the fields ``part`` declares (a class these settings compose, such
        as the training settings a task request and an experiment share): how one schema's values
        pass into another without naming each field."""
        return {name: getattr(self, name) for name in part.model_fields}


def parse_key_values(items: str, allowed: Sequence[str], setting: str, value: str, unknown: Callable[[str], str],
                     booleans: Sequence[str] = ()) -> dict[str, float | bool]:
    """``"k=v,k=v"`` (a small language's options) -> {key: a number, or true/false for ``booleans``};
    a ConfigError about ``setting``, given as ``value``, where an item is not ``KEY=VALUE`` with an
    ``allowed`` key (``unknown(item)`` says so) or its value is not of its kind."""
    fields: dict[str, float | bool] = {}
    for item in filter(None, (part.strip() for part in items.split(","))):
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep or key not in allowed:
            raise ConfigError(unknown(item), setting=setting, value=value)
        if key in booleans:
            if text.lower() not in ("true", "false"):
                raise ConfigError(f"{key} is true or false", setting=setting, value=value)
            fields[key] = text.lower() == "true"
            continue
        try:
            fields[key] = float(text)
        except ValueError:
            raise ConfigError(f"{key} must be a number", setting=setting, value=value) from None
    return fields


class SpecSettings(Settings):
    """Settings written as a small language (``nesterov:lr=0.7``, ``epsilon=8,delta=1e-5``): a string
    is ``parse``d once into the fields, and the settings are written back as their ``spec``."""

    @classmethod
    def parse(cls, text: str) -> dict[str, Any]:
        """The fields ``text`` says; ConfigError saying what is wrong."""
        raise NotImplementedError

    @classmethod
    def from_mapping(cls, value: dict) -> dict:
        """The fields of a mapping (a YAML map): as given by default."""
        return value

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if value is None:
            return {}
        if isinstance(value, str):
            return cls.parse(value)
        return cls.from_mapping(value) if isinstance(value, dict) else value

    @model_serializer
    def _as_string(self) -> str:
        return self.spec

    @property
    def spec(self) -> str:
        """The settings as written."""
        raise NotImplementedError


MIB = 2 ** 20  # bytes in a MiB
DEFAULT_MAX_MESSAGE_MB = 512.0
# The largest message a component accepts: one setting, ``max_message_mb``, written in MiB everywhere
# it is given (a flag, an experiment file, a section, a provider's settings, a task's engine), and
# read in bytes, ``max_message_bytes``, only where it is enforced (ZeroMQ, the decoders, the RPC).
MaxMessageMb = Annotated[float, Field(DEFAULT_MAX_MESSAGE_MB, gt=0, description="largest message accepted, in MiB")]


def message_bytes(max_message_mb: float) -> int:
    """The size limit ``max_message_mb`` (MiB) in whole bytes: the one place a limit given in MiB
    becomes the bytes it is enforced in."""
    return int(max_message_mb * MIB)


class MessageLimit(Settings):
    """Settings that cap the messages their component accepts: the subclass declares the field
    ``max_message_mb: MaxMessageMb`` among its own (where it shows in flags and files), and reads the
    cap in bytes here."""

    @property
    def max_message_bytes(self) -> int:
        """The cap in bytes, as it is enforced."""
        return message_bytes(self.max_message_mb)
