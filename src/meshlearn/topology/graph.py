"""An undirected graph of nodes 0..n-1: who talks to whom."""

from __future__ import annotations

from typing import Iterable

from meshlearn.errors import TopologyError


class Graph:
    """An immutable undirected simple graph on nodes ``0..n-1``."""

    def __init__(self, n: int, edges: Iterable[tuple[int, int]]):
        if n < 1:
            raise TopologyError(f"a graph needs at least one node (got {n})")
        adjacency: list[set[int]] = [set() for _ in range(n)]
        for u, v in edges:
            u, v = int(u), int(v)
            if not (0 <= u < n and 0 <= v < n):
                raise TopologyError(f"edge ({u}, {v}) names a node outside 0..{n - 1}")
            if u == v:
                raise TopologyError(f"edge ({u}, {v}) is a self loop; a node cannot be its own neighbour")
            adjacency[u].add(v)
            adjacency[v].add(u)
        self.n = n
        self._adjacency = tuple(tuple(sorted(a)) for a in adjacency)

    def neighbours(self, i: int) -> list[int]:
        """Sorted neighbours of node ``i``."""
        return list(self._adjacency[i])

    def degree(self, i: int) -> int:
        """Number of neighbours of node ``i``."""
        return len(self._adjacency[i])

    def edges(self) -> list[tuple[int, int]]:
        """Every edge once, as (u, v) with u < v, sorted."""
        return [(u, v) for u in range(self.n) for v in self._adjacency[u] if u < v]

    def components(self) -> int:
        """Number of connected components."""
        seen = [False] * self.n
        count = 0
        for root in range(self.n):
            if seen[root]:
                continue
            count += 1
            stack = [root]
            seen[root] = True
            while stack:
                for v in self._adjacency[stack.pop()]:
                    if not seen[v]:
                        seen[v] = True
                        stack.append(v)
        return count

    def is_connected(self) -> bool:
        """Whether every node can reach every other."""
        return self.components() == 1

    def require_connected(self) -> "Graph":
        """This graph, or a TopologyError if it is disconnected."""
        parts = self.components()
        if parts != 1:
            raise TopologyError(
                f"graph is disconnected ({parts} components); decentralized training needs a connected graph"
            )
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and self.n == other.n and self._adjacency == other._adjacency

    def __hash__(self) -> int:
        return hash((self.n, self._adjacency))

    def __repr__(self) -> str:
        return f"Graph(n={self.n}, edges={len(self.edges())})"
