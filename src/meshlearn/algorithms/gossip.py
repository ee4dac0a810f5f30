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
"""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterable

import torch

from meshlearn.aggregation.base import AggregationRule
from meshlearn.aggregation.suspects import PeerWatch, refusal
from meshlearn.algorithms.base import Algorithm, AlgorithmContext, register_runtime
from meshlearn.definitions.settings import GossipSettings
from meshlearn.flat import FlatState
from meshlearn.transport.pull import PullEndpoint
from meshlearn.wire import Message, meta_number, meta_real


def interpolation_factor(settings: GossipSettings, clock: float, peer_clock: float, loss: float,
                         peer_loss: float) -> float:
    """How much of the peer's state to take (0..1).

    constant: ``value``; clock: ``peer_clock / (clock + peer_clock)`` (the more the peer has
    trained, the more of it); loss: ``loss / (loss + peer_loss)`` (the worse my loss, the more I
    take; negative losses count as 0, so use ``clock`` or ``constant`` for objectives that go
    negative). Both ratios are 0.5 when numerator and denominator are 0. With a non-zero
    ``divergence_threshold`` and my loss below it, the factor is scaled by ``loss / threshold``,
    so a node that already fits its data well takes little from others.
    """
    if settings.interpolation == "constant":
        factor = settings.value
    elif settings.interpolation == "clock":
        factor = _share(peer_clock, clock)
    else:  # the ratio needs losses >= 0 (cross-entropy, MSE): a negative loss counts as 0
        factor = _share(max(loss, 0.0), max(peer_loss, 0.0))
    if settings.divergence_threshold and loss < settings.divergence_threshold:
        factor *= max(loss, 0.0) / settings.divergence_threshold
    return min(1.0, max(0.0, factor))


def _share(part: float, other: float) -> float:
    return part / (part + other) if part + other > 0 else 0.5


class PeerScores:
    """Flow control: every peer starts at 1000; +10 after a fetch that worked, -100 after one
    that failed, kept within 10..1000. ``pick`` takes the highest score plus a uniform random
    term of up to ``NOISE``, so a peer that keeps failing is chosen rarely but still retried
    (and climbs back once it answers). On top of dpwa's scores, a peer that gave no answer
    ``n >= 3`` times in a row sits out the next ``2 ** (n - 2)`` picks (at most ``MAX_BACKOFF``): a peer
    that accepts connections but never answers costs a whole timeout each time it is picked,
    and this makes its share of the picks 1.6% instead of 6.2% (two neighbours)."""

    START, REWARD, PENALTY, LOW, HIGH = 1000.0, 10.0, 100.0, 10.0, 1000.0
    NOISE = 1500.0
    MAX_BACKOFF = 64

    def __init__(self, peers: Iterable[int], rng: random.Random):
        self.score = {peer: self.START for peer in peers}
        self.rng = rng
        self.failures = {peer: 0 for peer in self.score}  # in a row
        self.sitting_out = {peer: 0 for peer in self.score}  # picks left before it may be chosen again

    def pick(self) -> int | None:
        """The peer to fetch from next, or None when every peer is sitting out."""
        ready = [peer for peer, left in self.sitting_out.items() if not left]
        for peer, left in self.sitting_out.items():
            if left:
                self.sitting_out[peer] = left - 1
        if not ready:
            return None
        return max(ready, key=lambda peer: self.score[peer] + self.rng.uniform(0.0, self.NOISE))

    def success(self, peer: int) -> None:
        self.score[peer] = min(self.HIGH, self.score[peer] + self.REWARD)
        self.failures[peer] = self.sitting_out[peer] = 0

    def failure(self, peer: int) -> None:
        """A fetch that got an answer that could not be used."""
        self.score[peer] = max(self.LOW, self.score[peer] - self.PENALTY)

    def no_answer(self, peer: int) -> None:
        """A fetch that got no answer at all (the costly kind: it may have waited a whole timeout)."""
        self.failure(peer)
        self.failures[peer] += 1
        if self.failures[peer] >= 3:
            self.sitting_out[peer] = min(self.MAX_BACKOFF, 2 ** (self.failures[peer] - 2))


class GossipAverager:
    """The exchange both the engine's ``gossip`` algorithm and the PyTorch adapter run."""

    def __init__(self, flat: FlatState, endpoint: PullEndpoint, peers: Iterable[int], settings: GossipSettings,
                 seed: int = 0, rule: AggregationRule | None = None, watch: PeerWatch | None = None,
                 forge: Callable[[torch.Tensor, int], torch.Tensor] | None = None):
        self.flat = flat
        self.rule = rule if rule is not None and rule.robust else None
        self.watch = watch if watch is not None else PeerWatch()
        self.forge = forge  # a bad node's attack: what it publishes for its state at a step
        self.latest: dict[int, torch.Tensor] = {}  # with a robust rule: each peer's latest model pulled
        self.endpoint = endpoint
        self.settings = settings
        self.rng = random.Random(seed)
        self.scores = PeerScores(sorted(peers), self.rng)
        self.clock = 0.0
        self.merges = 0
        self._trained_published = False  # update_wait published since the last update_send
        self._pending: tuple[int, Future, float] | None = None
        self._step_seconds = 0.0  # a moving average of the time from update_send to update_wait
        self._sent_at: float | None = None

    def update_send(self, loss: float | None) -> None:
        """Maybe start fetching a peer's state (returns at once); publish the current state if
        ``update_wait`` has not published a fresher one since the last call."""
        if not self._trained_published:
            self._publish(loss)
        self._trained_published = False
        if self._pending is None and self.scores.score and self.rng.random() < self.settings.fetch_probability \
                and (peer := self.scores.pick()) is not None:
            wait = min(self._step_seconds, self.settings.timeout / 2) if self.settings.fresh else 0.0
            self._pending = (peer, self.endpoint.fetch(peer, self.settings.timeout, wait),
                             time.monotonic() + self.settings.timeout)
        self._sent_at = time.monotonic()

    def _publish(self, loss: float | None) -> None:
        vector = self.flat.state.detach()
        if self.forge is not None:
            vector = self.forge(vector, int(self.clock))
        state = self.flat.segments_of(vector.to("cpu", copy=True))
        loss = float(loss or 0.0)
        # A loss that is not finite (a diverged worker) is published as null: peers take nothing from it.
        self.endpoint.publish(state, {"clock": self.clock, "loss": loss if math.isfinite(loss) else None})

    def update_wait(self, loss: float | None, steps: float = 1.0) -> dict[str, float]:
        """Count ``steps`` trained and publish the trained state; wait for the fetch started by
        ``update_send`` (never past its timeout) and interpolate with the peer. Returns what
        happened, for the run log."""
        self.clock += steps
        if self._sent_at is not None:
            took = time.monotonic() - self._sent_at
            self._step_seconds = took if not self._step_seconds else 0.8 * self._step_seconds + 0.2 * took
            self._sent_at = None
        self._publish(loss)
        self._trained_published = True
        if self._pending is None:
            return {"fetched": -1, "factor": 0.0, "comm": 0.0}
        peer, future, deadline = self._pending
        self._pending = None
        started = time.monotonic()
        try:
            reply = future.result(timeout=max(0.0, deadline - started) + 0.05)
        except FutureTimeout:  # the fetch thread ends it at its own deadline; stop waiting here
            reply = None
        waited = time.monotonic() - started
        peer_clock = None if reply is None else meta_number(reply.meta, "clock")
        peer_loss = None if reply is None else meta_real(reply.meta, "loss")
        if reply is None:
            self.scores.no_answer(peer)
            return {"fetched": peer, "factor": 0.0, "comm": waited, "failed": 1}
        problem = self.flat.check_compatible(reply.tensors)
        if problem is not None or peer_clock is None:
            self.watch.refused(peer, problem or "its clock is not a number")
            self.scores.failure(peer)  # another model, or a clock that is not a clock
            return {"fetched": peer, "factor": 0.0, "comm": waited, "failed": 1}
        if peer_loss is None:  # a diverged peer (null loss) or a loss that is not a number: not merged
            self.scores.failure(peer)
            return {"fetched": peer, "factor": 0.0, "comm": waited, "failed": 1, "diverged": 1}
        problem = next(filter(None, map(refusal, reply.tensors.values())), None)
        if problem is not None:  # NaN or Inf: refused before any rule sees it
            self.watch.refused(peer, problem)
            self.scores.failure(peer)
            return {"fetched": peer, "factor": 0.0, "comm": waited, "failed": 1}
        self.watch.heard(peer)
        self.scores.success(peer)
        own_loss = float(loss or 0.0)
        factor = 1.0 if not math.isfinite(own_loss) else \
            interpolation_factor(self.settings, self.clock, peer_clock, own_loss, peer_loss)
        t0 = time.monotonic()
        if self.rule is not None:
            self._merge_robust(peer, reply, factor)
        else:
            for name, target in self.flat.tensors().items():
                target.lerp_(reply.tensors[name].to(target.device), factor)
        self.clock = factor * peer_clock + (1 - factor) * self.clock
        self.merges += 1
        return {"fetched": peer, "factor": factor, "comm": waited, "average": time.monotonic() - t0}


    def _merge_robust(self, peer: int, reply: Message, factor: float) -> None:
        state = self.flat.state
        self.latest[peer] = torch.cat([reply.tensors[name].reshape(-1) for name in self.flat.ranges]).to(
            state.device, copy=True)
        with torch.no_grad():
            state.lerp_(robust_target(self.rule, state.detach(), self.latest, peer, self.watch,
                                      len(self.scores.score)), factor)


ROBUST_PEERS = 2  # peers' models a robust rule compares before a gossiping node moves at all


def robust_target(rule: AggregationRule, own: torch.Tensor, latest: dict[int, torch.Tensor], peer: int,
                  watch: PeerWatch, neighbours: int) -> torch.Tensor:
    """What a gossiping node moves toward under a robust ``rule``: the rule's aggregate of its own
    model and every peer's latest pulled one (equal weights), ``peer``'s just pulled (and judged
    for ``watch``). A pairwise pull alone gives a rule only two models, too few to outvote a bad
    one: until the node has pulled from two of its ``neighbours`` (or its only one), it stays
    where it is, or a bad peer pulled first would count as much as the node itself. Used by both
    engines."""
    if len(latest) < min(ROBUST_PEERS, neighbours):
        return own
    peers = sorted(latest)
    models = torch.stack([own, *(latest[q] for q in peers)])
    aggregate = rule(models, [1.0] * len(models))
    watch.observe(peers, models, aggregate, judged=peer)
    return aggregate


@register_runtime
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
        self._merged = self._failed = 0

    def before_step(self) -> None:
        self.averager.update_send(self._loss)

    def after_step(self, loss: float) -> None:
        self._loss = loss
        record = self.averager.update_wait(loss)
        self._comm += record.get("comm", 0.0)
        self._average += record.get("average", 0.0)
        self._merged += record["fetched"] >= 0 and not record.get("failed")
        self._failed += record.get("failed", 0)

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        record = {"comm": self._comm, "average": self._average, "merged": self._merged, "failed": self._failed,
                  "clock": self.averager.clock}
        self._comm = self._average = 0.0
        self._merged = self._failed = 0
        return record
