"""Names of aggregation rules and their arguments, checked without torch (configs and flags).

A rule is named ``NAME`` or ``NAME:ARG[:ARG]``: ``mean``, ``median``, ``trimmed-mean:B``,
``krum:F``, ``multi-krum:F:M``, ``clip``, ``clip:TAU``, ``clip:nearest`` or ``filter[:C]``. Rules a user registers (with
``register_rule``) take their arguments as written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshlearn.errors import ConfigError
from meshlearn.plugins import Registry

# name -> (argument names, how many may be left out from the end, their types)
BUILT_IN_RULES: dict[str, tuple[tuple[str, ...], int, type]] = {
    "mean": ((), 0, int),
    "median": ((), 0, int),
    "trimmed-mean": (("B",), 0, int),
    "krum": (("F",), 0, int),
    "multi-krum": (("F", "M"), 0, int),
    "clip": (("TAU",), 1, float),
    "filter": (("C",), 1, float),
}
RULE_MODULES = {"mean": "mean", "median": "median", "trimmed-mean": "trimmed_mean", "krum": "krum",
                "multi-krum": "krum", "clip": "clipping", "filter": "filtering"}
RULE_HELP = ("mean | median | trimmed-mean:B | krum:F | multi-krum:F:M | clip[:TAU|:nearest] (self-centred "
             "clipping; TAU left out: the median distance to the neighbours; nearest: the nearest one's) | "
             "filter[:C] (leave out models beyond C times the nearest one's distance, C 3 if left out)")
NEAREST = "nearest"  # clip's radius: the distance to the nearest neighbour


@dataclass(frozen=True)
class RuleSpec:
    """A parsed rule name: the rule and its arguments (numbers for built-in rules)."""

    name: str
    args: tuple

    def __str__(self) -> str:
        return ":".join([self.name, *(f"{a:g}" if isinstance(a, float) else str(a) for a in self.args)])


def parse_rule(text: str) -> RuleSpec:
    """``"trimmed-mean:1"`` -> RuleSpec("trimmed-mean", (1,)); ConfigError on a bad name or argument
    of a built-in rule (others are checked when their rule is built)."""
    name, *raw = [part.strip() for part in str(text).strip().split(":")]
    if name not in BUILT_IN_RULES:
        return RuleSpec(name, tuple(raw))
    names, optional, kind = BUILT_IN_RULES[name]
    usage = ":".join([name, *names])
    if not len(names) - optional <= len(raw) <= len(names):
        raise ConfigError(f"write it {usage}" + (" or " + name if optional else ""), setting="aggregation",
                          value=text)
    if name == "clip" and raw == [NEAREST]:
        return RuleSpec(name, (NEAREST,))
    try:
        args = tuple(kind(a) for a in raw)
    except ValueError:
        raise ConfigError(f"{', '.join(names)} must be {'whole numbers' if kind is int else 'numbers'} ({usage}"
                          f"{' or clip:nearest' if name == 'clip' else ''})", setting="aggregation", value=text) from None
    if any(not math.isfinite(a) or a < 0 for a in args) or (name == "multi-krum" and args[1] < 1) or \
            (name == "clip" and args and args[0] <= 0):
        raise ConfigError(f"its arguments must be positive numbers ({usage})", setting="aggregation", value=text)
    if name == "filter" and args and args[0] < 1:
        raise ConfigError("C must be at least 1 (the nearest neighbour always counts)", setting="aggregation",
                          value=text)
    return RuleSpec(name, args)


# name -> the rule's class; built-in ones are imported on first use (this module loads no torch)
RULES: Registry = Registry("aggregation rule", built_in={name: f"meshlearn.aggregation.{module}"
                                                         for name, module in RULE_MODULES.items()})


def check_rule(text: str) -> str:
    """``text`` normalised, if it names a known rule with valid arguments (settings validators)."""
    spec = parse_rule(text)
    RULES.check(spec.name)
    return str(spec) if spec.name in BUILT_IN_RULES else str(text).strip()
