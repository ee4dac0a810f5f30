"""Which class of the process engine runs an algorithm: its own runtime (``register_runtime``), or
the round runner of a ``RoundAlgorithm`` definition."""

from __future__ import annotations

from meshlearn.algorithms.base import ALGORITHMS, Algorithm, AlgorithmContext
from meshlearn.algorithms.rounds import runner_for
from meshlearn.definitions.base import RoundAlgorithm, definition
from meshlearn.errors import ConfigError


def algorithm_class(name: str) -> type[Algorithm]:
    """The process engine's class for the algorithm registered under ``name`` (ConfigError if
    none is): its own runtime, or the runner of a ``RoundAlgorithm``."""
    found = definition(name)
    if name in ALGORITHMS:
        return ALGORITHMS.get(name)
    if issubclass(found, RoundAlgorithm):
        return runner_for(found)
    raise ConfigError(f"algorithm {name} has no runtime in the process engine: give it one, or write it as a "
                      "RoundAlgorithm")


def make_algorithm(name: str, ctx: AlgorithmContext) -> Algorithm:
    """Build a registered algorithm by name."""
    return algorithm_class(name)(ctx)
