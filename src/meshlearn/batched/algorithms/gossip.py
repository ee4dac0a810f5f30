"""Gossip (dpwa's pairwise pulls) for every node at once, played out in modelled time.

Each node runs at its own pace (its step time, its ``slowdown``), as a process-engine gossip node
does: before each local step it may start fetching one peer (``fetch_probability``, the peer
picked by ``PeerScores``), trains, publishes its trained state, waits for the fetch (at most
``fetch_timeout`` from its start) and interpolates (``interpolation_factor``). A fetch reaches the
peer after a modelled latency; a fresh fetch (``fetch_fresh``) is held until the peer publishes
its next state or for as long as the fetching node's own step takes (at most half the timeout),
and is answered with the peer's published state at that moment (the pull merges the peer's state
as of the moment it is answered); the answer takes another latency to come back. A peer that has
finished all its steps is gone: fetching it fails at once. Everything happens in the order of
modelled time (an event queue); the nodes' steps are still computed together: a step only reads
and writes its own node's row, so every step that has started is computed in one vectorized call
the first time one of their results is needed. A node's decisions (whether and whom to fetch,
what it publishes, how a reply is read and judged, how its model moves, dpwa's clock) are its
``GossipState``, the process engine's own, reading the modelled time; each event kind is a method
of ``_GossipRun``, which only carries fetches and replies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from meshlearn.aggregation.base import get_rule
from meshlearn.aggregation.suspects import PeerWatch
from meshlearn.batched.algorithms.base import (
    AsyncDriver,
    BatchedAlgorithm,
    BatchedContext,
    Traffic,
)
from meshlearn.batched.byzantine import BadNodes
from meshlearn.batched.events import EventQueue, ModelledClock, PendingSteps
from meshlearn.definitions.gossipstate import Fetch, GossipState, Reply
from meshlearn.definitions.settings import GossipSettings

DONE, REQUEST, HOLD_END, REPLY, DEADLINE = range(5)


@dataclass
class _InFlight:
    """A node's fetch on its way: the ``GossipState``'s fetch, and what the modelled network did with it."""

    number: int  # the fetch's own number: events of an earlier fetch are recognised and ignored
    fetch: Fetch
    answer: Reply | None = None  # what the peer answered (None: not yet, or never)
    reply: Reply | None = None  # that answer, once it arrived in time (None: not yet, or never)
    gone: bool = False  # the peer had finished: failed at once


@dataclass
class _Node:
    """One node's progress through its steps (its gossip decisions: its ``GossipState``)."""

    step: int = 0
    done_at: float = 0.0  # when its current step's training ends
    waiting: bool = False  # trained and published, waiting for its fetch
    fetch: _InFlight | None = None
    loss: float | None = None
    held: list[tuple[int, int]] = field(default_factory=list)  # (node, fetch number) waiting for the next publish
    comm: float = 0.0  # this iteration's waiting
    losses: list[float] = field(default_factory=list)
    finished: bool = False


class BatchedGossip(BatchedAlgorithm):
    """dpwa's asynchronous pairwise averaging over the topology's neighbours, in modelled time."""

    name = "gossip"
    asynchronous = True

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        super().__init__(ctx, traffic)
        self.settings: GossipSettings = ctx.config.gossip
        self.clock = ModelledClock()
        rule = get_rule(ctx.config.aggregation)
        # each node's own stream and decisions, as a process-engine node's ``GossipAverager``
        self.gossips = [GossipState(ctx.graph.neighbours(rank), self.settings, ctx.config.seed * 7919 + rank, rule,
                                    PeerWatch(), self.clock) for rank in range(ctx.graph.n)]
        self.bad = BadNodes(ctx.config, 0, ctx.stacked.state, ctx.links, ctx.local)

    def peers_report(self) -> dict[int, dict]:
        reports = {rank: gossip.watch.report() for rank, gossip in enumerate(self.gossips)}
        return {rank: report for rank, report in reports.items() if report["peers"]}

    def drive(self, driver: AsyncDriver) -> None:
        """Run every node's steps in modelled time, through ``driver`` (training, records)."""
        _GossipRun(self, driver).run()


class _GossipRun:
    """One run of every node's steps and fetches, on one event queue: each event kind is a method
    (``done``, ``request``, ``hold_end``, ``reply``, ``deadline``), taking ``(rank, other, number,
    now)``; a node's decisions are its ``GossipState``'s."""

    def __init__(self, algorithm: BatchedGossip, driver: AsyncDriver):
        ctx = algorithm.ctx
        self.algorithm, self.driver, self.gossips, self.clock = algorithm, driver, algorithm.gossips, algorithm.clock
        self.config, self.clocks, self.traffic = ctx.config, ctx.clocks, algorithm.traffic
        self.state = ctx.stacked.state
        self.row_bytes = ctx.stacked.row_bytes
        self.total = self.config.iterations * self.config.rounds
        self.published = self.state.clone()  # what each node serves: its last trained state, before its merge
        for row in algorithm.bad.rows:
            self.published[row] = algorithm.bad.forge_row(row, self.state[row], 0)
        self.meta = [gossip.meta(None) for gossip in self.gossips]  # the clock and loss published with it
        self.answers = torch.empty_like(self.state)  # the state each node's fetch was answered with
        self.nodes = [_Node() for _ in range(self.config.nodes)]
        self.events = EventQueue()
        self.steps = PendingSteps(driver.train)
        self.numbers = itertools.count()
        self.handlers = {DONE: self.done, REQUEST: self.request, HOLD_END: self.hold_end, REPLY: self.reply,
                         DEADLINE: self.deadline}

    def run(self) -> None:
        """Start every node at time 0, then take the events in the order of modelled time."""
        for rank in range(self.config.nodes):
            self.start(rank, 0.0)
        while self.events:
            now, (kind, rank, other, number) = self.events.pop()
            self.clock.now = now
            self.handlers[kind](rank, other, number, now)

    def schedule(self, time: float, kind: int, rank: int, other: int = -1, number: int = -1) -> None:
        self.events.push(time, kind, rank, other, number)

    def latency(self) -> float:
        """One message's modelled time on the wire."""
        return self.clocks.latencies(1)[0]

    def start(self, rank: int, now: float) -> None:
        """Node ``rank`` starts its next step (maybe a fetch with it), or is finished."""
        me = self.nodes[rank]
        if me.step == self.total:
            me.finished = True
            self.driver.finished(rank, now)
            return
        step_seconds = self.clocks.step_seconds[rank]
        me.done_at = now + step_seconds
        self.steps.start(rank)
        me.fetch = None
        self.gossips[rank].start_step(float(step_seconds), lambda fetch: self.send(rank, fetch, now))
        self.schedule(me.done_at, DONE, rank)

    def send(self, rank: int, fetch: Fetch, now: float) -> None:
        """Node ``rank`` sends ``fetch``: its request reaches the peer after a latency, and the node
        gives up on it at its deadline."""
        flight = self.nodes[rank].fetch = _InFlight(next(self.numbers), fetch)
        self.traffic.sent(rank)
        self.schedule(now + self.latency(), REQUEST, fetch.peer, rank, flight.number)
        self.schedule(fetch.deadline, DEADLINE, rank, fetch.peer, flight.number)

    def done(self, rank: int, other: int, number: int, now: float) -> None:
        """Node ``rank``'s step is trained: it publishes, answers the fetches held for that, and
        merges (or waits for its fetch)."""
        me = self.nodes[rank]
        for trained, (loss,) in self.steps.settle(rank).items():  # every started step, computed together
            self.nodes[trained].loss = loss
            self.nodes[trained].losses.append(loss)
        self.publish(rank)
        for client, asked in me.held:
            self.answer(rank, client, asked, now)
        me.held.clear()
        fetch = me.fetch
        if fetch is None or fetch.gone or fetch.reply is not None or now >= fetch.fetch.deadline:
            self.merge(rank, now)
        else:
            me.waiting = True  # until its answer comes, or its fetch's deadline

    def publish(self, rank: int) -> None:
        """Node ``rank``'s step is trained: the state and meta it publishes now (its ``GossipState``'s
        ``publish``, as the process engine's), what its fetches are answered with from now on."""
        state, self.meta[rank] = self.gossips[rank].publish(self.state[rank], self.nodes[rank].loss,
                                                            forge=partial(self.algorithm.bad.forge_row, rank))
        self.published[rank].copy_(state)

    def request(self, rank: int, other: int, number: int, now: float) -> None:
        """Node ``other``'s fetch reaches ``rank``: gone, held for its next publish (fresh), or answered."""
        fetch = self.current(other, number)
        if fetch is None:
            return
        self.traffic.received(rank)
        if self.nodes[rank].finished:  # gone: the asking node's call fails at once
            fetch.gone = True
            if self.nodes[other].waiting:
                self.merge(other, now)
        elif fetch.fetch.wait > 0:  # fresh: held for the next publish, or the wait
            self.nodes[rank].held.append((other, number))
            self.schedule(now + fetch.fetch.wait, HOLD_END, rank, other, number)
        else:
            self.answer(rank, other, number, now)

    def hold_end(self, rank: int, other: int, number: int, now: float) -> None:
        """A fresh fetch's wait at ``rank`` ends: answered with what ``rank`` has, if still held."""
        held = self.nodes[rank].held
        if (other, number) in held:
            held.remove((other, number))
            self.answer(rank, other, number, now)

    def reply(self, rank: int, other: int, number: int, now: float) -> None:
        """``other``'s answer reaches ``rank``, the node asking: taken if before the deadline."""
        fetch = self.current(rank, number)
        if fetch is None or fetch.reply is not None or now > fetch.fetch.deadline:
            return
        fetch.reply = fetch.answer
        self.traffic.received(rank, self.row_bytes)
        if self.nodes[rank].waiting:
            self.merge(rank, now)

    def deadline(self, rank: int, other: int, number: int, now: float) -> None:
        """``rank``'s fetch times out: a node waiting for it merges without it."""
        fetch = self.current(rank, number)
        if fetch is not None and fetch.reply is None and self.nodes[rank].waiting:
            self.traffic.add_one("gather_timeouts", rank, 1)
            self.merge(rank, now)

    def current(self, client: int, number: int) -> _InFlight | None:
        """Node ``client``'s fetch, if ``number`` is still its current one."""
        fetch = self.nodes[client].fetch
        return fetch if fetch is not None and fetch.number == number else None

    def answer(self, server: int, client: int, number: int, now: float) -> None:
        """``server`` answers ``client``'s fetch with the state it publishes now (unless given up on)."""
        fetch = self.current(client, number)
        if fetch is None or now > fetch.fetch.deadline:
            return  # the asking node has given up on it
        self.answers[client].copy_(self.published[server])
        fetch.answer = Reply.read(self.meta[server], (self.answers[client],))
        self.traffic.sent(server, self.row_bytes)
        self.schedule(now + self.latency(), REPLY, client, server, number)

    def merge(self, rank: int, now: float) -> None:
        """Node ``rank``'s wait ends: it judges its fetch (merging an accepted answer), records a
        finished iteration, and starts its next step."""
        me = self.nodes[rank]
        me.comm += now - me.done_at
        if me.fetch is not None:
            self.gossips[rank].take(me.fetch.reply, me.loss, self.state[rank])
        me.waiting = False
        me.step += 1
        if me.step % self.config.rounds == 0:
            self.record(rank, now)
        self.start(rank, now)

    def record(self, rank: int, now: float) -> None:
        """Node ``rank`` finished an iteration: its log columns."""
        me, rounds = self.nodes[rank], self.config.rounds
        self.driver.record(rank, me.step // rounds - 1, now, {
            "train": rounds * float(self.clocks.step_seconds[rank]), "comm": me.comm, **self.gossips[rank].columns(),
            "train_loss": float(np.mean(me.losses))})
        me.comm, me.losses = 0.0, []
