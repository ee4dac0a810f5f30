"""Which class of the process engine runs an algorithm: its own runtime (``register_runtime``), or
the round runner of a ``RoundAlgorithm`` definition."""

from __future__ import annotations

from meshlearn.algorithms.base import ALGORITHMS, Algorithm, AlgorithmContext
from meshlearn.algorithms.rounds import RoundRunner
from meshlearn.definitions.base import engine_class


def algorithm_class(name: str) -> type[Algorithm]:
    """The process engine's class for the algorithm registered under ``name`` (ConfigError if
    none is): its own runtime, or the runner of a ``RoundAlgorithm``."""
    return engine_class(name, ALGORITHMS, RoundRunner, "process")


def make_algorithm(name: str, ctx: AlgorithmContext) -> Algorithm:
    """Build a registered algorithm by name."""
    return algorithm_class(name)(ctx)
