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
the first time one of their results is needed.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from meshlearn.aggregation.base import get_rule
from meshlearn.aggregation.suspects import PeerWatch, refusal
from meshlearn.algorithms.gossip import PeerScores, interpolation_factor, robust_target
from meshlearn.batched.algorithms.base import (
    AsyncDriver,
    BatchedAlgorithm,
    BatchedContext,
    Traffic,
    register_batched,
)
from meshlearn.batched.byzantine import BadNodes
from meshlearn.batched.events import EventQueue, PendingSteps
from meshlearn.definitions.settings import GossipSettings

START, DONE, REQUEST, HOLD_END, REPLY, DEADLINE = range(6)


@dataclass
class _Fetch:
    """A node's fetch in flight: from whom, when it started, when it gives up."""

    number: int  # the fetch's own number: events of an earlier fetch are recognised and ignored
    peer: int
    started: float
    deadline: float
    wait: float
    replied: float | None = None  # when the answer arrived (None: not yet, or never)
    answer_clock: float = 0.0
    answer_loss: float | None = None
    gone: bool = False  # the peer had finished: failed at once


@dataclass
class _Node:
    """One node's progress through its steps."""

    step: int = 0
    done_at: float = 0.0  # when its current step's training ends
    waiting: bool = False  # trained and published, waiting for its fetch
    fetch: _Fetch | None = None
    clock: float = 0.0  # dpwa's clock: steps trained, interpolated with the peers'
    loss: float | None = None
    held: list[tuple[int, int]] = field(default_factory=list)  # (node, fetch number) waiting for the next publish
    comm: float = 0.0  # this iteration's waiting, merges and failures
    merged: int = 0
    failed: int = 0
    losses: list[float] = field(default_factory=list)
    finished: bool = False


@register_batched
class BatchedGossip(BatchedAlgorithm):
    """dpwa's asynchronous pairwise averaging over the topology's neighbours, in modelled time."""

    name = "gossip"
    asynchronous = True

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        super().__init__(ctx, traffic)
        self.settings: GossipSettings = ctx.config.gossip
        seed = ctx.config.seed
        # each node's own stream, as a process-engine node seeds its averager
        self.rngs = [random.Random(seed * 7919 + rank) for rank in range(ctx.graph.n)]
        self.scores = [PeerScores(ctx.graph.neighbours(rank), self.rngs[rank]) for rank in range(ctx.graph.n)]
        rule = get_rule(ctx.config.aggregation)
        self.rule = rule if rule.robust else None  # as a process-engine node's ``GossipAverager``
        self.watches = [PeerWatch() for _ in range(ctx.graph.n)]
        self.latest: list[dict[int, torch.Tensor]] = [{} for _ in range(ctx.graph.n)]  # robust: peers' last pulls
        self.bad = BadNodes(ctx.config, 0, ctx.stacked.state, ctx.links, ctx.local)

    def peers_report(self) -> dict[int, dict]:
        reports = {rank: watch.report() for rank, watch in enumerate(self.watches)}
        return {rank: report for rank, report in reports.items() if report["peers"]}

    def drive(self, driver: AsyncDriver) -> None:
        """Run every node's steps in modelled time, through ``driver`` (training, records)."""
        ctx, settings = self.ctx, self.settings
        config, state, clocks = ctx.config, ctx.stacked.state, ctx.clocks
        nodes = config.nodes
        total = config.iterations * config.rounds
        step_seconds = clocks.step_seconds
        published = state.clone()  # what each node serves: its last trained state, before its merge
        for row in self.bad.rows:
            published[row] = self.bad.forge_row(row, state[row], 0)
        answers = torch.empty_like(state)  # the state each node's fetch was answered with
        node = [_Node() for _ in range(nodes)]
        events = EventQueue()
        steps = PendingSteps(driver.train)
        numbers = itertools.count()

        def push(time: float, kind: int, rank: int, other: int = -1, number: int = -1) -> None:
            events.push(time, kind, rank, other, number)

        def start(rank: int, now: float) -> None:
            me = node[rank]
            if me.step == total:
                me.finished = True
                driver.finished(rank, now)
                return
            me.done_at = now + step_seconds[rank]
            steps.start(rank)
            me.fetch = None
            rng = self.rngs[rank]
            if rng.random() < settings.fetch_probability and (peer := self.scores[rank].pick()) is not None:
                wait = min(float(step_seconds[rank]), settings.timeout / 2) if settings.fresh else 0.0
                me.fetch = _Fetch(next(numbers), peer, now, now + settings.timeout, wait)
                self.traffic.add_one("messages_sent", rank, 1)
                push(now + clocks.latencies(1)[0], REQUEST, peer, rank, me.fetch.number)
                push(me.fetch.deadline, DEADLINE, rank, peer, me.fetch.number)
            push(me.done_at, DONE, rank)

        def current(client: int, number: int) -> _Fetch | None:
            fetch = node[client].fetch
            return fetch if fetch is not None and fetch.number == number else None

        def answer(server: int, client: int, number: int, now: float) -> None:
            fetch = current(client, number)
            if fetch is None or now > fetch.deadline:
                return  # the asking node has given up on it
            answers[client].copy_(published[server])
            # a state published before any step carries loss 0, as a process-engine node publishes it
            fetch.answer_clock, fetch.answer_loss = node[server].clock, node[server].loss or 0.0
            self.traffic.add_one("messages_sent", server, 1)
            self.traffic.add_one("bytes_sent", server, ctx.stacked.row_bytes)
            push(now + clocks.latencies(1)[0], REPLY, client, server, number)

        def merge(rank: int, now: float) -> None:
            me = node[rank]
            me.comm += now - me.done_at
            fetch = me.fetch
            if fetch is not None:
                if fetch.replied is None:
                    self.scores[rank].no_answer(fetch.peer)
                    me.failed += 1
                elif fetch.answer_loss is None or not np.isfinite(fetch.answer_loss):
                    self.scores[rank].failure(fetch.peer)
                    me.failed += 1
                elif (problem := refusal(answers[rank])) is not None:
                    self.watches[rank].refused(fetch.peer, problem)
                    self.scores[rank].failure(fetch.peer)
                    me.failed += 1
                else:
                    self.watches[rank].heard(fetch.peer)
                    self.scores[rank].success(fetch.peer)
                    own = me.loss if me.loss is not None else 0.0
                    factor = 1.0 if not np.isfinite(own) else interpolation_factor(
                        settings, me.clock, fetch.answer_clock, own, fetch.answer_loss)
                    self._merge(rank, fetch.peer, answers[rank], factor)
                    me.clock = factor * fetch.answer_clock + (1 - factor) * me.clock
                    me.merged += 1
            me.waiting = False
            me.step += 1
            if me.step % config.rounds == 0:
                iteration = me.step // config.rounds - 1
                driver.record(rank, iteration, now, {
                    "train": config.rounds * float(step_seconds[rank]), "comm": me.comm, "merged": me.merged,
                    "failed": me.failed, "clock": me.clock, "train_loss": float(np.mean(me.losses))})
                me.comm, me.merged, me.failed, me.losses = 0.0, 0, 0, []
            start(rank, now)

        for rank in range(nodes):
            start(rank, 0.0)
        while events:
            now, (kind, rank, other, number) = events.pop()
            me = node[rank]
            if kind == DONE:
                for trained, (loss,) in steps.settle(rank).items():  # every started step, computed together
                    node[trained].loss = loss
                    node[trained].losses.append(loss)
                me.clock += 1
                published[rank].copy_(self.bad.forge_row(rank, state[rank], int(me.clock)))
                for client, asked in me.held:
                    answer(rank, client, asked, now)
                me.held.clear()
                fetch = me.fetch
                if fetch is None or fetch.gone or fetch.replied is not None or now >= fetch.deadline:
                    merge(rank, now)
                else:
                    me.waiting = True  # until its answer comes, or its fetch's deadline
            elif kind == REQUEST:  # rank is the peer asked, other the node asking
                fetch = current(other, number)
                if fetch is None:
                    continue
                self.traffic.add_one("messages_received", rank, 1)
                if me.finished:  # gone: the asking node's call fails at once
                    fetch.gone = True
                    if node[other].waiting:
                        merge(other, now)
                elif fetch.wait > 0:  # fresh: held for the next publish, or the wait
                    me.held.append((other, number))
                    push(now + fetch.wait, HOLD_END, rank, other, number)
                else:
                    answer(rank, other, number, now)
            elif kind == HOLD_END:
                if (other, number) in me.held:
                    me.held.remove((other, number))
                    answer(rank, other, number, now)
            elif kind == REPLY:  # rank is the node asking
                fetch = current(rank, number)
                if fetch is None or fetch.replied is not None or now > fetch.deadline:
                    continue
                fetch.replied = now
                self.traffic.add_one("messages_received", rank, 1)
                self.traffic.add_one("bytes_received", rank, ctx.stacked.row_bytes)
                if me.waiting:
                    merge(rank, now)
            elif kind == DEADLINE:
                fetch = current(rank, number)
                if fetch is not None and fetch.replied is None and me.waiting:
                    self.traffic.add_one("gather_timeouts", rank, 1)
                    merge(rank, now)

    def _merge(self, rank: int, peer: int, answer: torch.Tensor, factor: float) -> None:
        """Node ``rank`` moves toward ``answer`` (``peer``'s state) by ``factor``; with a robust rule,
        toward the rule's aggregate of its model and each peer's latest pulled one (equal weights)."""
        state = self.ctx.stacked.state
        if self.rule is None:
            state[rank].lerp_(answer, factor)
            return
        self.latest[rank][peer] = answer.clone()
        state[rank].lerp_(robust_target(self.rule, state[rank], self.latest[rank], peer, self.watches[rank],
                                        len(self.ctx.graph.neighbours(rank))), factor)
