"""Names of sharing schemes and their arguments, checked without torch (configs and flags).

A scheme is named ``NAME`` or ``NAME:ARG[:ARG]``: ``full``, ``subsample:ALPHA``, ``topk:ALPHA``,
``quantize:BITS`` or ``choco:ALPHA[:GAMMA]``. Schemes a user registers (``register_sharing``, in a
``--models-module``) take their arguments as written, checked when the scheme is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlearn.errors import ConfigError
from meshlearn.plugins import Registry
from meshlearn.suggest import did_you_mean

SHARING_HELP = ("full (the whole model) | subsample:ALPHA (a seeded random ALPHA share of the values; no "
                "indices sent) | topk:ALPHA (the ALPHA share that changed most since the last average, with "
                "their positions) | quantize:BITS (every value in 1, 2, 4 or 8 bits, stochastic rounding per "
                "bucket) | choco:ALPHA[:GAMMA] (CHOCO-SGD: top-ALPHA of the change to the public estimate, "
                "consensus step GAMMA, 0.5 if left out)")
# name -> (argument names, how many may be left out from the end)
SCHEMES: dict[str, tuple[tuple[str, ...], int]] = {
    "full": ((), 0), "subsample": (("ALPHA",), 0), "topk": (("ALPHA",), 0), "quantize": (("BITS",), 0),
    "choco": (("ALPHA", "GAMMA"), 1),
}
QUANTIZE_BITS = (1, 2, 4, 8)
# name -> the scheme's class; built-in ones are imported on first use (this module loads no torch)
SHARINGS: Registry = Registry("sharing scheme", built_in={name: f"meshlearn.sharing.{name}" for name in SCHEMES})


@dataclass(frozen=True)
class SharingSpec:
    """A parsed scheme name: the scheme and its arguments."""

    name: str
    args: tuple = ()  # numbers for built-in schemes, as written for a user's

    def __str__(self) -> str:
        return ":".join([self.name, *(f"{a:g}" if isinstance(a, float) else str(a) for a in self.args)])

    @property
    def full(self) -> bool:
        """Whether every value of the model is sent as it is (today's exchange)."""
        return self.name == "full"


def check_sharing(text: str) -> None:
    """ConfigError unless ``text`` names a built-in scheme or one a loaded module registered."""
    name = parse_sharing(text).name
    if name not in SHARINGS:
        raise ConfigError(f"unknown sharing scheme {text!r}: {did_you_mean(name, list(SCHEMES))}use one of "
                          f"{', '.join(SCHEMES)}, or register your own (register_sharing in a --models-module)")


def parse_sharing(text: str) -> SharingSpec:
    """``"topk:0.1"`` -> SharingSpec("topk", (0.1,)); ConfigError on a bad argument of a built-in
    scheme (a user's scheme takes its arguments as written)."""
    name, *raw = [part.strip() for part in str(text).strip().split(":")]
    if name.lower() not in SCHEMES:  # a user's scheme: checked once its module has loaded (check_sharing)
        return SharingSpec(name, tuple(raw))
    name = name.lower()
    names, optional = SCHEMES[name]
    usage = ":".join([name, *names])
    if not len(names) - optional <= len(raw) <= len(names):
        raise ConfigError(f"write it {usage}", setting="sharing", value=text)
    try:
        args = tuple(float(a) for a in raw)
    except ValueError:
        raise ConfigError(f"{', '.join(names)} must be numbers ({usage})", setting="sharing", value=text) from None
    if name == "quantize" and args[0] not in QUANTIZE_BITS:
        raise ConfigError(f"BITS must be one of {', '.join(map(str, QUANTIZE_BITS))}", setting="sharing",
                          value=text)
    if name in ("subsample", "topk", "choco") and not all(0 < a <= 1 for a in args):
        raise ConfigError(f"{' and '.join(names[:len(args)])} must be in (0, 1] (e.g. {name}:0.1)", setting="sharing",
                          value=text)
    return SharingSpec(name, tuple(int(a) if name == "quantize" else a for a in args))
