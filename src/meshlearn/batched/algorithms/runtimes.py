"""Which class of the batched engine runs an algorithm: its own runtime (``register_batched``), or
the round runner of a ``RoundAlgorithm`` definition."""

from __future__ import annotations

from meshlearn.batched.algorithms.base import BATCHED_ALGORITHMS, BatchedAlgorithm
from meshlearn.batched.algorithms.rounds import batched_runner_for
from meshlearn.definitions.base import RoundAlgorithm, definition
from meshlearn.errors import ConfigError


def batched_algorithm_class(name: str) -> type[BatchedAlgorithm]:
    """The batched engine's class for the algorithm registered under ``name`` (ConfigError if none
    is): its own runtime, or the runner of a ``RoundAlgorithm``."""
    found = definition(name)
    if name in BATCHED_ALGORITHMS:
        return BATCHED_ALGORITHMS.get(name)
    if issubclass(found, RoundAlgorithm):
        return batched_runner_for(found)
    raise ConfigError(f"algorithm {name} has no runtime in the batched engine: use the process engine, or write it "
                      "as a RoundAlgorithm")
