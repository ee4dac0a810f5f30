"""Algorithms: how nodes combine their models. Each registers itself by name."""

from meshlearn.algorithms.base import ALGORITHMS, Algorithm, AlgorithmContext, make_algorithm, register_algorithm
from meshlearn.algorithms.dpsgd import DPSGD

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmContext", "DPSGD", "make_algorithm", "register_algorithm"]
