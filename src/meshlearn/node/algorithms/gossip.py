"""Gossip: asynchronous pairwise averaging in the manner of dpwa.

Each step a node, with probability ``fetch_probability``, starts fetching one peer's state while
it trains; then it publishes its freshly trained state (parameters and floating-point buffers,
with its ``clock`` and ``loss``), waits for that fetch (at most ``fetch_timeout``) and
interpolates: ``state = factor * peer_state + (1 - factor) * state``. No barrier: a slow or dead
peer costs at most the timeout, and peer scores make it rarely chosen.

dpwa publishes in ``update_send``, before the step: what peers take then lacks the gradient the
node is computing, and the node keeps only ``1 - factor`` of its own step, so half of every
step's gradient is lost to the average. meshlearn publishes in ``update_wait``, right after the
step and before interpolating, so a peer gets a state that includes its latest gradient (measured
in benchmarks/RESULTS.md: 8 nodes reach 85-96% 1.1-1.4x sooner). ``update_send`` publishes only
while nothing fresher is out (the first step, or a loop that never calls ``update_wait``).

dpwa's fetch returns whatever the peer last published, a state already about a step old when it
is merged. meshlearn's fetch (``fresh``, on by default) asks the peer to hold the request for as
long as this node's own steps take (a moving average, at most half the timeout): a peer that
finishes a step meanwhile sends the newest such state, a slower one sends what it has when this
node needs it, so waiting costs nothing beyond dpwa's (measured in benchmarks/RESULTS.md: without
a straggler 1.2-1.4x sooner to 85-96% than dpwa's fetch, within about 10% of D-PSGD).

dpwa exchanges parameters only; meshlearn also interpolates floating-point buffers (BatchNorm
running statistics), as D-PSGD averages them, so a merged model is evaluated with statistics that
match its weights. ``num_batches_tracked`` stays local.

A node may join a group that trains (a network task's newcomer): every member adds it to the peers
it picks from (``add_member``; the training thread takes it in at its next step), and the newcomer
starts from the first peer's state that it can use, whole, with that peer's clock, at the
iteration that clock has reached.

A node's decisions (fetch or not, whom, judging the answer, the factor, dpwa's clock) are a
``GossipState`` (``definitions.gossipstate``), which the batched engine drives too; ``GossipAverager``
carries its fetches over a ``PullEndpoint`` from the training thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterable

import torch

from meshlearn.aggregation.base import AggregationRule
from meshlearn.aggregation.suspects import PeerWatch
from meshlearn.clock import SYSTEM, Clock
from meshlearn.definitions.gossipstate import (
    DIVERGED,
    Fetch,
    GossipState,
    PeerScores,
    Reply,
    Verdict,
)
from meshlearn.definitions.settings import GossipSettings
from meshlearn.errors import ConfigError
from meshlearn.flat import FlatState
from meshlearn.node.algorithms.base import Algorithm, AlgorithmContext
from meshlearn.transport.pull import PullEndpoint
from meshlearn.wire import Message


class GossipAverager:
    """The exchange both the engine's ``gossip`` algorithm and the PyTorch adapter run: a
    ``GossipState`` driven by the training thread, with its fetches carried by ``endpoint``."""

    def __init__(self, flat: FlatState, endpoint: PullEndpoint, peers: Iterable[int], settings: GossipSettings,
                 seed: int = 0, rule: AggregationRule | None = None, watch: PeerWatch | None = None,
                 forge: Callable[[torch.Tensor, int], torch.Tensor] | None = None, time: Clock = SYSTEM):
        self.flat = flat
        self.endpoint = endpoint
        self.forge = forge  # a bad node's attack: what it publishes for its state at a step
        self.node = GossipState(peers, settings, seed, rule, watch, time)
        self._trained_published = False  # update_wait published since the last update_send
        self._pending_answer: Future | None = None  # the pending fetch's answer, as the endpoint delivers it
        self._step_seconds = 0.0  # a moving average of the time from update_send to update_wait
        self._sent_at: float | None = None

    @property
    def clock(self) -> float:
        """dpwa's clock: steps trained, interpolated with the peers' clocks like the state."""
        return self.node.clock

    @property
    def scores(self) -> PeerScores:
        """The peers' scores (flow control)."""
        return self.node.scores

    @property
    def merges(self) -> int:
        """Fetches merged so far."""
        return self.node.merged

    def update_send(self, loss: float | None) -> None:
        """Maybe start fetching a peer's state (returns at once); publish the current state if
        ``update_wait`` has not published a fresher one since the last call."""
        if not self._trained_published:
            self._publish(loss)
        self._trained_published = False
        self.node.start_step(self._step_seconds, self._fetch)
        self._sent_at = self.node.time.monotonic()

    def _fetch(self, fetch: Fetch) -> None:
        """Send ``fetch`` over the endpoint (its answer arrives on a fetch thread)."""
        self._pending_answer = self.endpoint.fetch(fetch.peer, self.node.settings.timeout, fetch.wait)

    def _publish(self, loss: float | None, steps: float = 0.0) -> None:
        """Publish the state after ``steps`` more local steps (``GossipState.publish``)."""
        vector, meta = self.node.publish(self.flat.state.detach(), loss, steps, self.forge)
        self.endpoint.publish(self.flat.segments_of(vector.to("cpu", copy=True)), meta)

    def update_wait(self, loss: float | None, steps: float = 1.0) -> dict[str, float]:
        """Count ``steps`` trained and publish the trained state; wait for the fetch started by
        ``update_send`` (never past its timeout) and interpolate with the peer. Returns what
        happened, for the run log."""
        self._time_step()
        self._publish(loss, steps)
        self._trained_published = True
        fetch = self.node.fetch
        if fetch is None:
            return {"fetched": -1, "factor": 0.0, "comm": 0.0}
        started = self.node.time.monotonic()
        reply = self._answer(max(0.0, fetch.deadline - started) + 0.05)
        waited = self.node.time.monotonic() - started
        verdict, average = self.node.take(None if reply is None else self._judged(reply), loss, self.flat.state)
        return _step_record(verdict, waited, average)

    def _answer(self, timeout: float) -> Message | None:
        """The pending fetch's answer, or None after ``timeout`` seconds (the fetch thread ends the
        fetch at its own deadline: this only stops waiting). A fetch that failed is dropped."""
        future, self._pending_answer = self._pending_answer, None
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            return None
        except BaseException:
            self.node.cancel()
            raise

    def _time_step(self) -> None:
        """Fold the time since ``update_send`` into the moving average a fresh fetch waits for."""
        if self._sent_at is not None:
            took = self.node.time.monotonic() - self._sent_at
            self._step_seconds = took if not self._step_seconds else 0.8 * self._step_seconds + 0.2 * took
            self._sent_at = None

    def adopt(self, peers: Iterable[int], problems: list[str]) -> float | None:
        """Take the state of the first of ``peers`` that answers with one this node can use, whole
        (a newcomer's start); dpwa's clock then, or None if none could (why, per peer, in ``problems``)."""
        for peer in peers:
            reply = self.endpoint.fetch(peer, self.node.settings.timeout).result()
            if reply is None:
                problems.append(f"{peer} did not answer")
                continue
            judged = self._judged(reply)
            problem = self.node.adopt(judged)
            if problem is None:
                self.flat.state.copy_(torch.cat(list(judged.tensors)))
                return self.node.clock
            problems.append(f"{peer}: {problem}")
        return None

    def _judged(self, reply: Message) -> Reply:
        """A fetch's answer as ``GossipState.judge`` reads it: its segments in this state's order."""
        problem = self.flat.check_compatible(reply.tensors)
        return Reply.read(reply.meta, () if problem else [reply.tensors[name] for name in self.flat.ranges], problem)


def _step_record(verdict: Verdict, waited: float, average: float) -> dict[str, float]:
    """What ``update_wait`` returns for the run log: the fetch's ``verdict``, the seconds ``waited``
    for it and, merged, those its ``average`` took."""
    record = {"fetched": verdict.peer, "factor": verdict.factor, "comm": waited}
    if not verdict.merged:
        return {**record, "failed": 1, **({"diverged": 1} if verdict.outcome == DIVERGED else {})}
    return {**record, "average": average}


class Gossip(Algorithm):
    """Asynchronous pairwise averaging over the topology's neighbours (dpwa's scheme): an
    exchange around every local step, as dpwa's adapter does around every batch."""

    name = "gossip"
    endpoint = PullEndpoint

    def __init__(self, ctx: AlgorithmContext):
        super().__init__(ctx)
        self.settings = ctx.settings or GossipSettings()
        self.averager = GossipAverager(ctx.flat, ctx.transport, ctx.graph.neighbours(ctx.rank), self.settings,
                                       seed=ctx.seed * 7919 + ctx.rank, rule=self.rule, watch=self.watch,
                                       forge=None if ctx.attack is None else ctx.outgoing)
        self._loss: float | None = None
        self._comm = self._average = 0.0
        self._joined: list[int] = []  # members that joined, for the training thread to take in
        self._joined_lock = threading.Lock()

    def start(self) -> None:
        ctx = self.ctx
        peers = sorted(set(ctx.graph.neighbours(ctx.rank)) & set(ctx.transport.peers))
        self.averager.node.scores.only(peers)  # a network task's slots that no provider holds yet
        if ctx.joining:
            problems: list[str] = []
            clock = self.averager.adopt(peers, problems)
            if clock is None:
                raise ConfigError("a node joining the group could take no member's model: " + "; ".join(problems))
            self.joined_at = min(ctx.iterations - 1, int(clock // max(1, ctx.steps)))

    def add_member(self, rank: int, address: str, at: int | None = None) -> None:
        self.ctx.transport.add_peer(rank, address)
        with self._joined_lock:
            self._joined.append(rank)

    def before_step(self) -> None:
        if self._joined:
            with self._joined_lock:
                joined, self._joined = self._joined, []
            for rank in joined:
                self.averager.node.scores.add(rank)
        self.averager.update_send(self._loss)

    def after_step(self, loss: float) -> None:
        self._loss = loss
        record = self.averager.update_wait(loss)
        self._comm += record.get("comm", 0.0)
        self._average += record.get("average", 0.0)

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        record = {"comm": self._comm, "average": self._average, **self.averager.node.columns()}
        self._comm = self._average = 0.0
        return record
