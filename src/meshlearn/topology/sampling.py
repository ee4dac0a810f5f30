"""Dynamic topologies: who sends to whom changes every round, drawn from the run's seed.

Every node draws the same rounds itself (the seed and the iteration are all it needs), so no
coordinator is involved, unlike DecentralizePy's peer-sampler process.

- ``graph``: each round a new graph from the run's random ``topology`` generator (a fresh random
  d-regular graph for ``regular:D``, fresh neighbours for ``erdos:P``), averaged with that
  round's Metropolis-Hastings weights (DecentralizePy's ``DPSGDWithPeerSampler``).
- ``epidemic:S``: Epidemic Learning (Vogels et al. 2023, EL-Local): each node sends its model to S
  others drawn uniformly each round; each node averages its own model and those it received with
  equal weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshlearn.errors import TopologyError
from meshlearn.topology.generators import build_topology
from meshlearn.topology.weights import mh_row

SAMPLING_HELP = ("off (the topology's graph all run) | graph (a new graph from the random topology's generator "
                 "every round, Metropolis-Hastings weights) | epidemic:S (Epidemic Learning: each node sends to S "
                 "others drawn every round; equal weights)")
RANDOM_TOPOLOGIES = ("regular", "erdos", "erdos-renyi", "smallworld", "small-world")
SALT = 0xE9D


def check_sampling(spec: str, topology: str, n: int) -> str:
    """``spec`` normalised, or TopologyError saying what is wrong (configs and flags)."""
    name, _, arg = spec.strip().lower().partition(":")
    if name == "off" and not arg:
        return "off"
    if name == "graph" and not arg:
        if topology.partition(":")[0] not in RANDOM_TOPOLOGIES:
            raise TopologyError(f"peer_sampling graph draws a new graph each round from a random topology "
                                f"(regular:D, erdos:P, smallworld:K:P), not {topology!r}")
        return "graph"
    if name == "epidemic" and arg.isdigit() and 1 <= int(arg) < n:
        return f"epidemic:{int(arg)}"
    raise TopologyError(f"peer_sampling {spec!r}: use off, graph, or epidemic:S with S from 1 to {n - 1} "
                        f"(nodes each one sends to)")


@dataclass(frozen=True)
class Round:
    """One round's exchange: per node, whom it sends to, whom it hears from, and the weight of
    each sender in its average (its own model keeps the rest)."""

    send_to: tuple[tuple[int, ...], ...]
    receive_from: tuple[tuple[int, ...], ...]
    weights: tuple[dict[int, float], ...]


class PeerSampler:
    """The rounds of a run with ``peer_sampling`` ``spec`` (see the module), for ``n`` nodes."""

    def __init__(self, spec: str, topology: str, n: int, seed: int):
        self.spec, self.topology, self.n, self.seed = check_sampling(spec, topology, n), topology, n, seed
        self._last: tuple[int, Round] | None = None

    def round(self, iteration: int) -> Round:
        """The exchange of ``iteration`` (the same on every node)."""
        if self._last is None or self._last[0] != iteration:
            self._last = (iteration, self._draw(iteration))
        return self._last[1]

    def _draw(self, iteration: int) -> Round:
        if self.spec == "graph":
            graph = None
            for attempt in range(100):  # a draw that is not connected is drawn again (erdos:P)
                seed = int(np.random.SeedSequence([self.seed, SALT, iteration, attempt]).generate_state(1)[0])
                try:
                    graph = build_topology(self.topology, self.n, seed)
                    break
                except TopologyError:
                    continue
            if graph is None:
                raise TopologyError(f"{self.topology}: no connected graph in 100 draws for iteration {iteration}")
            peers = tuple(tuple(graph.neighbours(i)) for i in range(self.n))
            weights = tuple({j: w for j, w in mh_row(graph, i).items() if j != i} for i in range(self.n))
            return Round(peers, peers, weights)
        fanout = int(self.spec.partition(":")[2])
        rng = np.random.default_rng([self.seed, SALT, iteration])
        send_to = []
        for i in range(self.n):
            others = rng.choice(self.n - 1, size=fanout, replace=False)
            send_to.append(tuple(sorted(int(j) + int(j >= i) for j in others)))  # skip i itself
        receive_from: list[list[int]] = [[] for _ in range(self.n)]
        for i, targets in enumerate(send_to):
            for j in targets:
                receive_from[j].append(i)
        weights = tuple({i: 1.0 / (1 + len(senders)) for i in senders} for senders in receive_from)
        return Round(tuple(send_to), tuple(tuple(r) for r in receive_from), weights)
