"""Which object of the process engine runs an algorithm: its own runtime, for the built-in
algorithms that have one (local, gossip, the leader), or the round runner given the algorithm's
``RoundAlgorithm`` definition (D-PSGD, push-sum, gradient tracking, FedAvg, a user's)."""

from __future__ import annotations

from meshlearn.definitions.base import round_algorithm
from meshlearn.node.algorithms.base import Algorithm, AlgorithmContext, LocalOnly
from meshlearn.node.algorithms.gossip import Gossip
from meshlearn.node.algorithms.leader import Leader
from meshlearn.node.algorithms.rounds import RoundRunner

_RUNTIMES: dict[str, type[Algorithm]] = {"local": LocalOnly, "gossip": Gossip, "leader": Leader}


def make_algorithm(name: str, ctx: AlgorithmContext) -> Algorithm:
    """The process engine's runtime of the algorithm registered under ``name``, for the node of
    ``ctx``: its own, or the round runner of a ``RoundAlgorithm`` (ConfigError if it is neither)."""
    if name in _RUNTIMES:
        return _RUNTIMES[name](ctx)
    return RoundRunner(ctx, round_algorithm(name, "process"))
