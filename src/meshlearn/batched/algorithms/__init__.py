"""The batched engine's algorithms: one file each, registered by name (``BATCHED_ALGORITHMS``)."""

from meshlearn.batched.algorithms.base import (
    BATCHED_ALGORITHMS,
    BatchedAlgorithm,
    BatchedContext,
    Traffic,
    register_batched,
)
from meshlearn.batched.algorithms.runtimes import batched_algorithm_class

__all__ = ["BATCHED_ALGORITHMS", "BatchedAlgorithm", "BatchedContext", "Traffic", "batched_algorithm_class",
           "register_batched"]
