"""Leader aggregation (CloudMesh's design) for every node at once, played out in modelled time.

As in the process engine: after its local steps every member pushes its model to the leader (the
lowest rank; members do not fail here, so there is no fail-over) and waits for the aggregate it
answers with, then trains on from it. The leader's book is the process engine's ``LeaderState``
on a modelled clock: it keeps every member's latest model, answers at once with the
staleness-weighted aggregate, except that the first cycle waits for every member (up to
``wait_timeout``) and a final push waits for every member's final model. A push takes a modelled
latency to reach the leader (none for the leader's own), and the answer one to come back. Members
keep pinging a living leader in the process engine, so none is ever counted lost here.
Synchronous (``leader.sync``): the book holds every push until each member pushed its cycle, as
the process engine's does, and answers all of them with that cycle's aggregate. A member's
decisions (its cycle, its push and its loss, the seconds it waited, when it is finished) are its
``LeaderMember``, the process engine's own, reading the modelled time; each event kind is a method
of ``_LeaderRun``, which only carries pushes and answers.
"""

from __future__ import annotations

import torch

from meshlearn.aggregation.suspects import PeerWatch
from meshlearn.batched.algorithms.base import (
    AsyncDriver,
    BatchedAlgorithm,
    BatchedContext,
    Traffic,
)
from meshlearn.batched.byzantine import BadNodes
from meshlearn.batched.events import EventQueue, ModelledClock, PendingSteps
from meshlearn.definitions.leadermember import LeaderMember
from meshlearn.definitions.leaderstate import LeaderState

DONE, PUSH, REPLY, BARRIER = range(4)
LEADER = 0


class BatchedLeader(BatchedAlgorithm):
    """Leader aggregation over every node of the run, in modelled time (asynchronous or synchronous)."""

    name = "leader"
    asynchronous = True

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        super().__init__(ctx, traffic)
        self.settings = ctx.config.leader
        self.bad = BadNodes(ctx.config, 0, ctx.stacked.state, ctx.links, ctx.local)
        self.watch = PeerWatch()

    def peers_report(self) -> dict[int, dict]:
        report = self.watch.report()
        return {LEADER: report} if report["peers"] else {}

    def drive(self, driver: AsyncDriver) -> None:
        """Run every member's iterations and pushes in modelled time, through ``driver``."""
        _LeaderRun(self, driver).run()

    def book(self, clock: ModelledClock) -> LeaderState:
        """The leader's book, as the process engine's leader keeps it, on the modelled ``clock``."""
        config = self.ctx.config
        return LeaderState.of(self.settings, list(range(config.nodes)), LEADER, config.seed, config.tcp.wait_timeout,
                              rule=config.aggregation, watch=self.watch, clock=clock)


class _LeaderRun:
    """One run of every member's iterations and pushes, on one event queue: each event kind is a
    method (``done``, ``push_arrives``, ``barrier``, ``reply``), taking ``(rank, now)``."""

    def __init__(self, algorithm: BatchedLeader, driver: AsyncDriver):
        ctx = algorithm.ctx
        self.algorithm, self.driver, self.config, self.traffic = algorithm, driver, ctx.config, algorithm.traffic
        self.state, self.clocks = ctx.stacked.state, ctx.clocks
        self.size = ctx.stacked.row_bytes
        self.clock = ModelledClock()
        self.book = algorithm.book(self.clock)
        self.answers: dict[int, torch.Tensor] = {}  # the aggregate each member was answered with
        self.held: list[int] = []  # pushes the book may not answer yet
        self.members = [LeaderMember(ctx.samples[rank], self.config.iterations, self.clock)
                        for rank in range(self.config.nodes)]  # each member's decisions, as a process engine's
        self.events = EventQueue()
        self.steps = PendingSteps(driver.train, self.config.rounds)
        self.handlers = {DONE: self.done, PUSH: self.push_arrives, BARRIER: self.barrier, REPLY: self.reply}

    def run(self) -> None:
        """Start every member at time 0, then take the events in the order of modelled time."""
        nodes = self.config.nodes
        for rank in range(nodes):
            self.start(rank, 0.0)
        barrier = self.book.first_deadline()
        if barrier is not None:
            self.events.push(barrier, BARRIER, LEADER)
        while self.events:
            now, (kind, rank) = self.events.pop()
            self.clock.now = now
            for member in range(nodes):  # living members keep pinging the leader
                self.book.touch(member)
            self.handlers[kind](rank, now)

    def start(self, rank: int, now: float) -> None:
        """Member ``rank`` starts its next iteration's local steps, or is finished."""
        if self.members[rank].finished:
            self.driver.finished(rank, now)
            return
        self.steps.start(rank)
        self.events.push(now + self.config.rounds * float(self.clocks.step_seconds[rank]), DONE, rank)

    def done(self, rank: int, now: float) -> None:
        """Member ``rank``'s local steps are trained: it pushes its model to the leader."""
        for member, trained in self.steps.settle(rank).items():  # every started iteration, together
            self.members[member].trained(*trained)
        self.members[rank].pushing()
        self._send(PUSH, rank, rank, now)

    def push_arrives(self, rank: int, now: float) -> None:
        """Member ``rank``'s push reaches the leader: recorded in the book, answered once it may be."""
        if rank != LEADER:
            self.traffic.received(LEADER, self.size)
        member = self.members[rank]
        self.book.take(rank, member.push(self.algorithm.bad.forge_row(rank, self.state[rank], member.cycle)))
        self.held.append(rank)
        self.release(now)

    def barrier(self, rank: int, now: float) -> None:
        """The first cycle stops waiting for latecomers."""
        self.release(now)

    def reply(self, rank: int, now: float) -> None:
        """The leader's answer reaches member ``rank``: it trains on from the aggregate."""
        if rank != LEADER:
            self.traffic.received(rank, self.size)
        self.state[rank].copy_(self.answers.pop(rank))  # (an outer step follows in ``record``, as in the process engine)
        member = self.members[rank]
        done = member.cycle
        self.driver.record(rank, done, now, {
            "train": self.config.rounds * float(self.clocks.step_seconds[rank]), "comm": member.answered(),
            "leader": LEADER, "train_loss": member.loss})
        self.start(rank, now)

    def release(self, now: float) -> None:
        """Answer the held pushes the book allows now."""
        for rank, aggregate in self.book.release(self.held).items():
            self.held.remove(rank)
            self.answers[rank] = aggregate.to(self.state.device)
            self._send(REPLY, rank, LEADER, now)

    def _send(self, kind: int, member: int, sender: int, now: float) -> None:
        """A message between the leader and ``member``, sent by ``sender`` at ``now``: event ``kind``
        for ``member`` a latency later (at once, and not counted, for the leader's own)."""
        latency = 0.0
        if member != LEADER:
            latency = float(self.clocks.latencies(1)[0])
            self.traffic.sent(sender, self.size)
        self.events.push(now + latency, kind, member)
