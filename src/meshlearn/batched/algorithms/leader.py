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
the process engine's does, and answers all of them with that cycle's aggregate.
"""

from __future__ import annotations

import torch

from meshlearn.aggregation.suspects import PeerWatch
from meshlearn.algorithms.fedavg import participants
from meshlearn.algorithms.leaderstate import LeaderState
from meshlearn.batched.algorithms.base import (
    AsyncDriver,
    BatchedAlgorithm,
    BatchedContext,
    Traffic,
    register_batched,
)
from meshlearn.batched.byzantine import BadNodes
from meshlearn.batched.events import EventQueue, PendingSteps
from meshlearn.clock import Clock

DONE, PUSH, REPLY, BARRIER = range(4)
LEADER = 0


class ModelledClock(Clock):
    """A clock that reads the modelled time the event queue has reached."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


@register_batched
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
        ctx, config = self.ctx, self.ctx.config
        state, clocks, nodes = ctx.stacked.state, ctx.clocks, config.nodes
        clock = ModelledClock()
        book = LeaderState(list(range(nodes)), LEADER, config.tcp.wait_timeout, self.settings.first_barrier,
                           self.settings.weighting, rule=config.aggregation, clock=clock, watch=self.watch,
                           sync=self.settings.sync, drawn=None if self.settings.fraction == 1 else
                           lambda cycle: participants(config.seed, cycle, nodes, self.settings.fraction))
        answers: dict[int, torch.Tensor] = {}  # the aggregate each member was answered with
        held: list[int] = []  # pushes the book may not answer yet
        iteration = [0] * nodes
        pushed_at = [0.0] * nodes
        events = EventQueue()
        steps = PendingSteps(driver.train, config.rounds)
        size = ctx.stacked.row_bytes
        push = events.push

        def start(rank: int, now: float) -> None:
            if iteration[rank] == config.iterations:
                driver.finished(rank, now)
                return
            steps.start(rank)
            push(now + config.rounds * float(clocks.step_seconds[rank]), DONE, rank)

        def answer(rank: int, now: float) -> None:
            answers[rank] = book.answer_for(rank).to(state.device)
            latency = 0.0 if rank == LEADER else float(clocks.latencies(1)[0])
            if rank != LEADER:
                self.traffic.add_one("messages_sent", LEADER, 1)
                self.traffic.add_one("bytes_sent", LEADER, size)
            push(now + latency, REPLY, rank)

        def release(now: float) -> None:
            for rank in book.answerable(list(held)):
                held.remove(rank)
                answer(rank, now)

        for rank in range(nodes):
            start(rank, 0.0)
        if self.settings.first_barrier:
            push(config.tcp.wait_timeout, BARRIER, LEADER)
        losses: dict[int, list[float]] = {rank: [] for rank in range(nodes)}
        while events:
            now, (kind, rank) = events.pop()
            clock.now = now
            for member in range(nodes):  # living members keep pinging the leader
                book.touch(member)
            if kind == DONE:
                for member, trained in steps.settle(rank).items():  # every started iteration, together
                    losses[member] += trained
                pushed_at[rank] = now
                latency = 0.0 if rank == LEADER else float(clocks.latencies(1)[0])
                if rank != LEADER:
                    self.traffic.add_one("messages_sent", rank, 1)
                    self.traffic.add_one("bytes_sent", rank, size)
                push(now + latency, PUSH, rank)
            elif kind == PUSH:
                if rank != LEADER:
                    self.traffic.add_one("messages_received", LEADER, 1)
                    self.traffic.add_one("bytes_received", LEADER, size)
                final = iteration[rank] + 1 == config.iterations
                trained = losses[rank]  # the local steps that made this model (a final one that diverged is left out)
                book.submit(rank, self.bad.forge_row(rank, state[rank], iteration[rank]), ctx.samples[rank], final,
                            cycle=iteration[rank], loss=sum(trained) / len(trained) if trained else None)
                held.append(rank)
                release(now)
            elif kind == BARRIER:
                release(now)  # the first cycle stops waiting for latecomers
            elif kind == REPLY:
                if rank != LEADER:
                    self.traffic.add_one("messages_received", rank, 1)
                    self.traffic.add_one("bytes_received", rank, size)
                state[rank].copy_(answers.pop(rank))
                done = iteration[rank]
                iteration[rank] += 1
                spent = config.rounds * float(clocks.step_seconds[rank])
                driver.record(rank, done, now, {
                    "train": spent, "comm": now - pushed_at[rank], "leader": LEADER,
                    "train_loss": sum(losses[rank]) / len(losses[rank]) if losses[rank] else None})
                losses[rank] = []
                start(rank, now)
