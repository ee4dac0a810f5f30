"""Which class of the batched engine runs an algorithm: its own runtime (``register_batched``), or
the round runner of a ``RoundAlgorithm`` definition."""

from __future__ import annotations

from meshlearn.batched.algorithms.base import BATCHED_ALGORITHMS, BatchedAlgorithm
from meshlearn.batched.algorithms.rounds import BatchedRounds
from meshlearn.definitions.base import engine_class


def batched_algorithm_class(name: str) -> type[BatchedAlgorithm]:
    """The batched engine's class for the algorithm registered under ``name`` (ConfigError if none
    is): its own runtime, or the runner of a ``RoundAlgorithm``."""
    return engine_class(name, BATCHED_ALGORITHMS, BatchedRounds, "batched")
