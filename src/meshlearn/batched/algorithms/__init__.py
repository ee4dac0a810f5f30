"""The batched engine's algorithms: the interface (``base``), the round runner of every
``RoundAlgorithm`` (``rounds``), the runtimes of the built-in algorithms that need their own, one
file each, and ``make_batched_algorithm``, which picks one by name."""

from meshlearn.batched.algorithms.base import BatchedAlgorithm, BatchedContext, Traffic
from meshlearn.batched.algorithms.runtimes import make_batched_algorithm

__all__ = ["BatchedAlgorithm", "BatchedContext", "Traffic", "make_batched_algorithm"]
