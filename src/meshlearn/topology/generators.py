"""Seeded graph generators and the ``build_topology`` spec parser."""

from __future__ import annotations

import math
import random

from meshlearn.errors import TopologyError
from meshlearn.suggest import did_you_mean
from meshlearn.topology.graph import Graph

SPECS = "ring, torus, star, full, regular:D, smallworld:K:P, erdos:P, one-peer-exponential, file:PATH"
ONE_PEER_EXPONENTIAL = "one-peer-exponential"
NAMES = ("ring", "torus", "star", "full", "regular", "smallworld", "erdos", ONE_PEER_EXPONENTIAL, "file")  # SPECS' names
MAX_TRIES = 1000


def _need(n: int, at_least: int, what: str) -> None:
    if n < at_least:
        raise TopologyError(f"a {what} needs at least {at_least} nodes (got {n})")


def ring(n: int) -> Graph:
    """Each node linked to the next, the last to the first."""
    _need(n, 2, "ring")
    return Graph(n, [(i, (i + 1) % n) for i in range(n)])


def torus(n: int) -> Graph:
    """A 2-D torus (wrap-around grid) of rows x cols = n, as square as n allows."""
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    if rows < 3:
        raise TopologyError(
            f"a 2-D torus of {n} nodes would be {rows} x {n // rows}; use a node count with a factor of at least 3 "
            "on both sides (9, 12, 16, ...) or another topology"
        )
    cols = n // rows
    edges = []
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            edges += [(i, r * cols + (c + 1) % cols), (i, ((r + 1) % rows) * cols + c)]
    return Graph(n, edges)


def star(n: int) -> Graph:
    """Node 0 linked to every other node."""
    _need(n, 2, "star")
    return Graph(n, [(0, i) for i in range(1, n)])


def fully_connected(n: int) -> Graph:
    """Every node linked to every other."""
    _need(n, 2, "fully connected graph")
    return Graph(n, [(i, j) for i in range(n) for j in range(i + 1, n)])


def regular(n: int, d: int, seed: int) -> Graph:
    """A random connected d-regular graph (pairing model with retries), the same for the same seed."""
    if d < 1 or d >= n:
        raise TopologyError(f"regular:{d} with {n} nodes: the degree must be between 1 and {n - 1}")
    if n * d % 2:
        raise TopologyError(f"regular:{d} with {n} nodes: n*d must be even; use an even node count or degree")
    rng = random.Random(seed)
    for _ in range(MAX_TRIES):
        graph = _random_regular(n, d, rng)
        if graph is not None and graph.is_connected():
            return graph
    raise TopologyError(f"could not draw a connected {d}-regular graph on {n} nodes; try another degree")


def _random_regular(n: int, d: int, rng: random.Random) -> Graph | None:
    """One attempt at a simple d-regular graph by random stub matching; None if it got stuck."""
    edges: set[tuple[int, int]] = set()
    stubs = [i for i in range(n) for _ in range(d)]
    rng.shuffle(stubs)
    while stubs:
        placed = False
        for _ in range(100):
            a, b = rng.sample(range(len(stubs)), 2)
            u, v = stubs[a], stubs[b]
            edge = (min(u, v), max(u, v))
            if u != v and edge not in edges:
                edges.add(edge)
                for index in sorted((a, b), reverse=True):
                    stubs.pop(index)
                placed = True
                break
        if not placed:
            return None
    return Graph(n, edges)


def small_world(n: int, k: int, p: float, seed: int) -> Graph:
    """Watts-Strogatz: a ring lattice of k nearest neighbours with each edge rewired with probability p."""
    if k < 2 or k % 2 or k >= n:
        raise TopologyError(f"smallworld:{k}:{p} with {n} nodes: K must be even, at least 2 and below {n}")
    if not 0 <= p <= 1:
        raise TopologyError(f"smallworld:{k}:{p}: the rewiring probability must be in 0..1")
    rng = random.Random(seed)
    for _ in range(MAX_TRIES):
        edges = {(i, (i + s) % n) for i in range(n) for s in range(1, k // 2 + 1)}
        edges = {(min(u, v), max(u, v)) for u, v in edges}
        for u, v in sorted(edges):
            if rng.random() < p:
                choices = [w for w in range(n) if w != u and (min(u, w), max(u, w)) not in edges]
                if choices:
                    w = rng.choice(choices)
                    edges.discard((u, v))
                    edges.add((min(u, w), max(u, w)))
        graph = Graph(n, edges)
        if graph.is_connected():
            return graph
    raise TopologyError("could not draw a connected small-world graph; lower P or raise K")


def erdos_renyi(n: int, p: float, seed: int) -> Graph:
    """G(n, p): each possible edge present with probability p, redrawn until connected."""
    _need(n, 2, "random graph")
    if not 0 < p <= 1:
        raise TopologyError(f"erdos:{p}: the edge probability must be in (0, 1]")
    rng = random.Random(seed)
    for _ in range(MAX_TRIES):
        graph = Graph(n, [(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < p])
        if graph.is_connected():
            return graph
    raise TopologyError(f"erdos:{p} with {n} nodes stayed disconnected in {MAX_TRIES} draws; use a larger P")


def exponential_hops(n: int) -> list[int]:
    """The hops of the exponential graph on ``n`` nodes: 1, 2, 4, ... below ``n``."""
    return [1 << k for k in range(max(1, math.ceil(math.log2(n))))]


def exponential(n: int) -> Graph:
    """Every node linked to those 1, 2, 4, ... places after it (mod n): the undirected union of the
    one-peer exponential graph's rounds (Ying et al. 2021), which ``topology.sampling`` walks."""
    _need(n, 2, "one-peer exponential graph")
    return Graph(n, [(i, (i + hop) % n) for i in range(n) for hop in exponential_hops(n) if (i + hop) % n != i])


def _number(text: str, kind, spec: str):
    try:
        return kind(text)
    except ValueError:
        raise TopologyError(f"{text!r} is not a number; valid topologies: {SPECS}", setting="topology",
                            value=spec) from None


def build_topology(spec: str, n: int, seed: int) -> Graph:
    """The connected graph a spec names (see SPECS), for ``n`` nodes and ``seed``."""
    from meshlearn.topology.files import read_graph_file

    name, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    if name == "file":
        graph = read_graph_file(rest)
        if graph.n != n:
            raise TopologyError(f"graph file {rest} has {graph.n} nodes but the run has {n}: make them agree")
    elif name == "ring" and not args:
        graph = ring(n)
    elif name == "torus" and not args:
        graph = torus(n)
    elif name == "star" and not args:
        graph = star(n)
    elif name in ("full", "fully-connected") and not args:
        graph = fully_connected(n)
    elif name == "regular" and len(args) == 1:
        graph = regular(n, _number(args[0], int, spec), seed)
    elif name in ("smallworld", "small-world") and len(args) == 2:
        graph = small_world(n, _number(args[0], int, spec), _number(args[1], float, spec), seed)
    elif name == ONE_PEER_EXPONENTIAL and not args:
        graph = exponential(n)
    elif name in ("erdos", "erdos-renyi") and len(args) == 1:
        graph = erdos_renyi(n, _number(args[0], float, spec), seed)
    else:
        raise TopologyError(f"unknown topology {spec!r}: {did_you_mean(name, NAMES)}use one of {SPECS}")
    return graph.require_connected()
