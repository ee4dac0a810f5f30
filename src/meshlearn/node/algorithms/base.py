"""The process engine's algorithm interface: how a node exchanges and merges models; and the local
baseline's runtime (no exchange)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Mapping

import torch

from meshlearn.aggregation.base import get_rule
from meshlearn.aggregation.suspects import PeerWatch
from meshlearn.checkpoint import Stateful
from meshlearn.definitions.exchange import BadSenders
from meshlearn.definitions.mixing import MixingSettings
from meshlearn.errors import ConfigError
from meshlearn.flat import FlatState
from meshlearn.privacy.mechanism import Privacy
from meshlearn.settings import Settings
from meshlearn.topology import Graph
from meshlearn.transport.base import Endpoint, Unconnected
from meshlearn.wire import Message

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from meshlearn.attacks.forge import Attack
    from meshlearn.topology.sampling import Rounds


@dataclass
class AlgorithmContext:
    """What an algorithm may use of its node: identity, state, link, its own settings, the run's
    shape (seed, samples in the node's shard and in every node's, iterations), the aggregation rule its node applies,
    the sharing scheme (what it sends of its model), the peer sampler of a dynamic topology,
    for a bad node, its ``attack`` (with ``initial``, its first model, and the other bad
    nodes it colludes with; ``bad``: what it sends), and the node's active privacy mechanisms,
    whose hooks an algorithm calls where it pushes and aggregates (``privacy``: the leader's), and
    how many exchanges with its neighbours a synchronous algorithm's iteration holds (``mixing``)
    and what its nodes minimise together (``objective``)."""

    rank: int
    flat: FlatState
    transport: Endpoint
    graph: Graph
    settings: Settings | None = None
    seed: int = 0
    samples: int = 0
    shard_sizes: tuple[int, ...] = ()  # every node's training samples (the seeded partition), where known
    iterations: int = 0
    steps: int = 1  # local steps per iteration
    rule: str = "mean"
    sharing: str = "full"
    sampler: "Rounds | None" = None  # dynamic topologies: each iteration's peers
    attack: "Attack | None" = None
    initial: torch.Tensor | None = None
    colluders: frozenset[int] = frozenset()  # for a bad node: the run's other bad nodes
    joining: bool = False  # a node joining a group that already trains (a network task's newcomer)
    members: tuple[int, ...] | None = None  # a group that takes in nodes as it runs: its members now (None: every node)
    privacy: Privacy = field(default_factory=Privacy)
    mixing: MixingSettings | None = None  # exchanges with the neighbours per iteration (None: one)
    objective: str = "nodes"  # what the nodes minimise together (``definitions.objective``)
    bad: BadSenders = field(init=False)  # what this node sends in place of its payloads (nothing else: honest)

    def __post_init__(self) -> None:
        self.bad = BadSenders([] if self.attack is None else [(0, self.rank, self.attack)], self.seed,
                              None if self.initial is None else self.initial.unsqueeze(0))

    def outgoing(self, state: torch.Tensor, iteration: int) -> torch.Tensor:
        """The flat model this node sends for ``state`` where no attack sees its peers' models
        first: ``state`` itself, or what its attack forges (``BadSenders.forged_row``)."""
        return self.bad.forged_row(0, state, iteration)


class Algorithm(Stateful, ABC):
    """A way of combining models across nodes, called by the node's run loop.

    ``before_local_steps`` runs once per iteration before the local SGD steps, ``before_step`` and
    ``after_step`` around each step (gossip exchanges there), and ``after_local_steps`` after
    them; it returns timings and counters for the run log. Algorithms that work alongside training
    (gossip, the leader's watcher) start their helpers in ``start`` and stop them in ``stop``.
    ``endpoint`` is the class of endpoint the algorithm needs, which the node factory builds (a
    ``Transport`` means TCP or UDP, as configured); ``talks_to`` says whether it exchanges with
    its neighbours in the topology, with everyone, or (``server``) node 0 with everyone and the
    others with node 0. ``state_fields``: what a checkpoint keeps of it (none by default: a resumed
    node starts its exchanges afresh).
    """

    name: ClassVar[str]
    endpoint: ClassVar[type[Endpoint]] = Unconnected
    talks_to: ClassVar[Literal["neighbours", "everyone", "server"]] = "neighbours"

    def __init__(self, ctx: AlgorithmContext):
        if not isinstance(ctx.transport, self.endpoint):
            raise ConfigError(f"the {self.name} algorithm needs a {self.endpoint.__name__}, not a "
                              f"{type(ctx.transport).__name__}")
        self.ctx = ctx
        self.rule = get_rule(ctx.rule)
        self.watch = PeerWatch()  # refused and deviant models, per peer

    def peers_report(self) -> dict:
        """Refused and deviant models per peer, and the suspected peers (the run log's final event)."""
        return self.watch.report()

    def admit(self, received: Mapping[int, Message], problem_of: Callable[[Message], str | None]) -> list[int]:
        """The senders whose messages may be merged, in rank order (so that a run is bit-for-bit
        reproducible); the others (``problem_of`` says why) are refused, counted per peer and logged."""
        usable = []
        for sender in sorted(received):
            problem = problem_of(received[sender])
            if problem is None:
                usable.append(sender)
                self.watch.heard(sender)
            else:
                self.refuse(sender, problem)
        return usable

    def refuse(self, sender: int, problem: str) -> None:
        """Refuse ``sender``'s message (``problem``: why): counted against it and logged."""
        self.watch.refused(sender, problem)
        log.warning("node %d: refused the model of %d: %s", self.ctx.rank, sender, problem)

    def start(self) -> None:
        """Called once the transport is connected, before the first iteration."""

    def task_report(self) -> dict:
        """What this algorithm adds to a network task's result (``metrics.json``): none by default."""
        return {}

    joined_at: int | None = None  # a joining node: the iteration it starts at, once ``start`` joined the group
    join_round: int | None = None  # a joining node of a round algorithm: the round the group takes it in at

    def add_member(self, rank: int, address: str, at: int | None = None) -> None:
        """Take in ``rank``, at ``address``, joining the group while it runs (a network task's
        newcomer; ``at``: the round it is a member from, for algorithms whose members must all take
        it in at one round): the algorithms that can say so; the others refuse it (ConfigError)."""
        raise ConfigError(f"the {self.name} algorithm does not take in nodes while it runs")

    def exclude(self, rank: int) -> None:
        """Go on without ``rank`` for good (a network task's provider whose key was revoked: it
        may run on): its messages are dropped, nothing is sent to it, nobody waits for it. Safe
        from any thread."""
        self.ctx.transport.exclude(rank)

    def local_optimizer(self, optimizer: Any) -> Any:
        """What the node's local steps call in place of its ``optimizer`` (``RoundAlgorithm.local_optimizer``):
        the optimizer itself for an algorithm that leaves the steps to it."""
        return optimizer

    def before_local_steps(self, iteration: int) -> None:
        """Called at the start of each iteration, before the local steps."""

    def aggregated(self, iteration: int) -> tuple[int, int] | None:
        """The part [a, b) of the state ``iteration``'s exchange aggregated (an outer optimizer steps
        only it); None: all of it."""
        return None

    def trains(self, iteration: int) -> bool:
        """Whether this node's local steps of ``iteration`` are asked for (a node not drawn for a
        round of partial participation skips them, where its optimizer allows: ``steps_rows_apart``)."""
        return True

    def before_step(self) -> None:
        """Called before each local SGD step (gossip publishes and may start a fetch here)."""

    def after_step(self, loss: float) -> None:
        """Called after each local SGD step with its loss (gossip merges a fetched peer here)."""

    @abstractmethod
    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        """Exchange and update the node's state for this iteration (``train_loss``: mean of its steps)."""

    def stop(self) -> None:
        """Called once after the last iteration, before the transport closes."""

    def check(self) -> None:
        """Raise ``ThreadFailed`` if a background thread the algorithm or its endpoint depends on
        has died (the node calls this after each iteration)."""
        self.ctx.transport.check()


class LocalOnly(Algorithm):
    """No exchange: each node trains alone (a baseline)."""

    name = "local"

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        return {}
