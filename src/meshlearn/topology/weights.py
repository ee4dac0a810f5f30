"""Metropolis-Hastings mixing weights: symmetric, doubly stochastic, local to each node."""

from __future__ import annotations

import numpy as np

from meshlearn.topology.graph import Graph


def mh_row(graph: Graph, i: int) -> dict[int, float]:
    """Node ``i``'s weights: ``w_ij = 1 / (1 + max(d_i, d_j))`` for neighbours, ``w_ii`` the rest."""
    d_i = graph.degree(i)
    row = {j: 1.0 / (1 + max(d_i, graph.degree(j))) for j in graph.neighbours(i)}
    row[i] = 1.0 - sum(row.values())
    return row


def metropolis_hastings(graph: Graph) -> np.ndarray:
    """The full n x n Metropolis-Hastings weight matrix."""
    matrix = np.zeros((graph.n, graph.n))
    for i in range(graph.n):
        for j, w in mh_row(graph, i).items():
            matrix[i, j] = w
    return matrix
