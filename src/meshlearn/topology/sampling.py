"""Dynamic topologies: who sends to whom changes every round, drawn from the run's seed.

Every node draws the same rounds itself (the seed and the iteration are all it needs), so no
coordinator is involved, unlike DecentralizePy's peer-sampler process.

- ``graph``: each round a new graph from the run's random ``topology`` generator (a fresh random
  d-regular graph for ``regular:D``, fresh neighbours for ``erdos:P``), averaged with that
  round's Metropolis-Hastings weights (DecentralizePy's ``DPSGDWithPeerSampler``).
- ``epidemic:S``: Epidemic Learning (Vogels et al. 2023, EL-Local): each node sends its model to S
  others drawn uniformly each round; each node averages its own model and those it received with
  equal weights.

A topology can be dynamic too: ``one-peer-exponential`` (Ying et al. 2021, BlueFog's default) has
every node send to one peer per round, 1, 2, 4, ... places after it in turn (``OnePeerExponential``).
``rounds_of`` gives any run's rounds, static or not, as ``Round``s.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Protocol

import numpy as np

from meshlearn.errors import TopologyError
from meshlearn.suggest import did_you_mean
from meshlearn.topology.generators import ONE_PEER_EXPONENTIAL, build_topology, exponential_hops
from meshlearn.topology.graph import Graph
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
    raise TopologyError(f"{did_you_mean(name, ('off', 'graph', 'epidemic'))}use off, graph, or epidemic:S with S "
                        f"from 1 to {n - 1} (nodes each one sends to)", setting="peer_sampling", value=spec)


@dataclass(frozen=True)
class Round:
    """One round's exchange: per node, whom it sends to, whom it hears from, and the weight of
    each sender in its average (its own model keeps the rest)."""

    send_to: tuple[tuple[int, ...], ...]
    receive_from: tuple[tuple[int, ...], ...]
    weights: tuple[dict[int, float], ...]

    @classmethod
    def of_graph(cls, graph: Graph) -> "Round":
        """Every round of a static undirected graph: both ways over each edge, Metropolis-Hastings weights."""
        peers = tuple(tuple(graph.neighbours(i)) for i in range(graph.n))
        return cls(peers, peers, tuple({j: w for j, w in mh_row(graph, i).items() if j != i} for i in range(graph.n)))


class Rounds(Protocol):
    """Who sends to whom in each round of a run."""

    def round(self, iteration: int) -> Round:
        """The exchange of ``iteration`` (the same on every node)."""


class StaticRounds:
    """The rounds of a static topology: its graph's every round."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._round: Round | None = None  # made when first asked for (FedAvg never asks: 38 MB at 100,000 nodes)

    def round(self, iteration: int) -> Round:
        """The graph's exchange, whatever the iteration."""
        if self._round is None:
            self._round = Round.of_graph(self.graph)
        return self._round


class GrowingRounds:
    """The rounds of a complete graph whose members join as it runs (a network task's providers,
    newcomers among them): each round is the complete graph of that round's members, each weighing
    ``1/m`` (Metropolis-Hastings on it). A member joining at round ``J`` listens in round ``J - 1``:
    every member sends it its model too, and it takes their plain average (the model each member
    holds after that round), sending nothing; from round ``J`` on it is a member. Ranks may exceed
    the run's first size (a newcomer in a lost provider's place takes the next rank). ``join`` may
    be called from any thread, and refuses a round this node has already begun (``round`` was asked
    for it or a later one): every member must take a newcomer in at the same round."""

    def __init__(self, members: Iterable[int]):
        self.start = frozenset(members)
        self._joins: dict[int, int] = {}  # newcomer -> the round it is a member from
        self._asked = -1  # the latest round ``round`` gave
        self._lock = threading.Lock()
        self._rounds: dict[tuple[frozenset[int], frozenset[int]], Round] = {}

    def join(self, rank: int, at: int) -> None:
        """Take ``rank`` in from round ``at`` (TopologyError if that round or the one before, where it
        listens, has begun here, or it is a member already)."""
        with self._lock:
            if rank in self.start or rank in self._joins:
                raise TopologyError(f"node {rank} is a member already")
            if at - 1 <= self._asked:
                raise TopologyError(f"round {at - 1} has begun here (round {self._asked}): too late to take "
                                    f"in node {rank} at round {at}")
            self._joins[rank] = at

    def members(self, iteration: int) -> frozenset[int]:
        """The members of round ``iteration``."""
        return self.start | {rank for rank, at in self._joins.items() if at <= iteration}

    def round(self, iteration: int) -> Round:
        """Round ``iteration``'s exchange among its members (and to those listening in it)."""
        with self._lock:
            self._asked = max(self._asked, iteration)
            members = self.members(iteration)
            listening = frozenset(rank for rank, at in self._joins.items() if at == iteration + 1)
            key = (members, listening)
            if key not in self._rounds:
                self._rounds[key] = self._among(members, listening)
            return self._rounds[key]

    def _among(self, members: frozenset[int], listening: frozenset[int]) -> Round:
        n = max(members | listening | self.start | set(self._joins), default=-1) + 1
        send_to: list[tuple[int, ...]] = [()] * n
        receive_from: list[tuple[int, ...]] = [()] * n
        weights: list[dict[int, float]] = [{} for _ in range(n)]
        for i in members:
            peers = tuple(sorted(members - {i}))
            send_to[i], receive_from[i] = tuple(sorted({*peers, *listening})), peers
            weights[i] = {j: 1.0 / len(members) for j in peers}
        for k in listening:
            receive_from[k] = tuple(sorted(members))
            weights[k] = {j: 1.0 / len(members) for j in members}
        return Round(tuple(send_to), tuple(receive_from), tuple(weights))


class OnePeerExponential:
    """The one-peer exponential graph (Ying et al. 2021): in round t every node i sends to
    ``i + 2^(t mod log2 n)`` (mod n) and hears from ``i - 2^(t mod log2 n)``, each weighing the
    other's model 1/2. Every round is doubly stochastic; ``log2 n`` rounds in a row average exactly
    when n is a power of two."""

    def __init__(self, n: int):
        self.n = n
        self.hops = exponential_hops(n)

    def round(self, iteration: int) -> Round:
        """Round ``iteration``'s one peer per node."""
        hop, n = self.hops[iteration % len(self.hops)], self.n
        return Round(tuple(((i + hop) % n,) for i in range(n)), tuple(((i - hop) % n,) for i in range(n)),
                     tuple({(i - hop) % n: 0.5} for i in range(n)))


def dynamic_rounds(peer_sampling: str, topology: str, n: int, seed: int) -> "PeerSampler | OnePeerExponential | None":
    """The rounds of a run whose peers change every round (``peer_sampling``, or a dynamic
    topology such as one-peer-exponential); None for a static graph."""
    if peer_sampling != "off":
        return PeerSampler(peer_sampling, topology, n, seed)
    if topology == ONE_PEER_EXPONENTIAL:
        return OnePeerExponential(n)
    return None


def rounds_of(peer_sampling: str, topology: str, graph: Graph, seed: int) -> Rounds:
    """Every run's rounds: dynamic ones (``dynamic_rounds``), or the static graph's."""
    return dynamic_rounds(peer_sampling, topology, graph.n, seed) or StaticRounds(graph)


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
            return Round.of_graph(graph)
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
