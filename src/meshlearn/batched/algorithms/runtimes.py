"""Which object of the batched engine runs an algorithm: its own runtime, for the built-in
algorithms that have one, or the round runner given the algorithm's ``RoundAlgorithm`` definition."""

from __future__ import annotations

from meshlearn.batched.algorithms.base import BatchedAlgorithm, BatchedContext, Traffic
from meshlearn.batched.algorithms.gossip import BatchedGossip
from meshlearn.batched.algorithms.leader import BatchedLeader
from meshlearn.batched.algorithms.local import BatchedLocal
from meshlearn.batched.algorithms.rounds import BatchedRounds
from meshlearn.definitions.base import round_algorithm

_RUNTIMES: dict[str, type[BatchedAlgorithm]] = {"local": BatchedLocal, "gossip": BatchedGossip, "leader": BatchedLeader}


def make_batched_algorithm(name: str, ctx: BatchedContext, traffic: Traffic) -> BatchedAlgorithm:
    """The batched engine's runtime of the algorithm registered under ``name``, for the nodes of
    ``ctx``: its own, or the round runner of a ``RoundAlgorithm`` (ConfigError if it is neither)."""
    if name in _RUNTIMES:
        return _RUNTIMES[name](ctx, traffic)
    return BatchedRounds(ctx, traffic, round_algorithm(name, "batched"))
