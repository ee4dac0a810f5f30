"""Algorithms: how nodes combine their models. Each registers itself by name."""

from meshlearn.algorithms.base import ALGORITHMS, Algorithm, AlgorithmContext, make_algorithm, register_algorithm
from meshlearn.algorithms.dpsgd import DPSGD
from meshlearn.algorithms.gossip import Gossip, GossipAverager, GossipSettings

__all__ = [
    "ALGORITHMS", "Algorithm", "AlgorithmContext", "DPSGD", "Gossip", "GossipAverager", "GossipSettings",
    "make_algorithm", "register_algorithm",
]
