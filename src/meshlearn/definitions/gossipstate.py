"""One gossiping node's decisions, as a state machine both engines drive (as ``LeaderState`` is the
leader's book for both).

``GossipState`` holds what dpwa's node keeps between steps: its random stream, its peers' scores
(``PeerScores``), what it saw of each peer (``PeerWatch``), dpwa's clock (steps trained,
interpolated with the peers'), the fetch it has pending, and, with a robust rule, each peer's
latest pulled model. Its events are short methods, called by both engines in one order:
``start_step`` (before a local step: maybe start a fetch, handed to the engine to send),
``publish`` (a step done, ``trained``: the state it publishes and ``meta``, what goes with it), ``judge``
(the fetch ended: with a ``Reply``, read from what the peer published, or with none) and ``move``
(a merged verdict moves the node's model: a lerp toward the peer, or a robust rule's merge), the
two together ``take``.
Time is read from an injected ``Clock``: the process engine's threads use the real one
(``GossipAverager``), the batched engine's event queue a modelled one
(``batched.algorithms.gossip``), tests a ``FakeClock``. Carrying requests and replies stays with
the engines: a process-engine node over its pull endpoint's sockets, the batched engine as events
with modelled latencies.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from meshlearn.aggregation.base import AggregationRule
from meshlearn.aggregation.suspects import PeerWatch, refusal
from meshlearn.clock import SYSTEM, Clock
from meshlearn.definitions.settings import GossipSettings
from meshlearn.meta import meta_number, meta_real

ROBUST_PEERS = 2  # peers' models a robust rule compares before a gossiping node moves at all
NO_ANSWER, REFUSED, DIVERGED, MERGED = "no answer", "refused", "diverged", "merged"


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
        """A fetch whose answer was merged."""
        self.score[peer] = min(self.HIGH, self.score[peer] + self.REWARD)
        self.failures[peer] = self.sitting_out[peer] = 0

    def failure(self, peer: int) -> None:
        """A fetch that got an answer that could not be used."""
        self.score[peer] = max(self.LOW, self.score[peer] - self.PENALTY)

    def add(self, peer: int) -> None:
        """A peer that joined while the node runs: picked from now on, as a fresh peer is."""
        if peer not in self.score:
            self.score[peer], self.failures[peer], self.sitting_out[peer] = self.START, 0, 0

    def only(self, peers: Iterable[int]) -> None:
        """Forget every peer not in ``peers`` (a network task's slots no provider holds yet)."""
        keep = set(peers)
        for book in (self.score, self.failures, self.sitting_out):
            for peer in [q for q in book if q not in keep]:
                del book[peer]

    def no_answer(self, peer: int) -> None:
        """A fetch that got no answer at all (the costly kind: it may have waited a whole timeout)."""
        self.failure(peer)
        self.failures[peer] += 1
        if self.failures[peer] >= 3:
            self.sitting_out[peer] = min(self.MAX_BACKOFF, 2 ** (self.failures[peer] - 2))


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


@dataclass(frozen=True)
class Fetch:
    """A fetch a node started: the peer asked, how long the peer may hold it for the state it
    finishes next (``wait``: 0 for dpwa's fetch of what it already has), and when (on the node's
    clock) the node started it and gives up on it."""

    peer: int
    wait: float
    started: float
    deadline: float


@dataclass(frozen=True)
class Reply:
    """A peer's answer to a fetch, as the engine received it: the clock and loss the peer
    published with its state (None where not a number; a loss that is None or not finite is a
    diverged peer's), the state's ``tensors``, and ``problem``: why the engine cannot use them at
    all (another model's tensors), where it found one."""

    clock: float | None
    loss: float | None
    tensors: Sequence[torch.Tensor]
    problem: str | None = None

    @classmethod
    def read(cls, meta: dict[str, Any], tensors: Sequence[torch.Tensor], problem: str | None = None) -> "Reply":
        """A peer's answer from the ``meta`` it published with its state (``GossipState.meta``),
        checked as anything from a peer is: a clock that is not a number >= 0, or a loss that is not
        a finite number, reads as None. ``tensors``: the state, cut as the node's own state is."""
        return cls(meta_number(meta, "clock"), meta_real(meta, "loss"), tensors, problem)


@dataclass(frozen=True)
class Verdict:
    """How a fetch of ``peer`` ended: ``outcome`` is ``MERGED`` (move toward the peer's state,
    ``pulled``, by ``factor``), ``NO_ANSWER``, ``REFUSED`` (another model, or NaN or Inf in it) or
    ``DIVERGED`` (the peer's loss is not finite: nothing taken from it)."""

    peer: int
    outcome: str
    factor: float = 0.0
    pulled: Sequence[torch.Tensor] = field(default=(), repr=False, compare=False)

    @property
    def merged(self) -> bool:
        """Whether the node takes ``factor`` of the peer's state."""
        return self.outcome == MERGED


class GossipState:
    """One gossiping node's state machine, shared by the process engine (``GossipAverager``), the
    PyTorch adapter and the batched engine (see the module). Seeded with ``seed``: a node's fetch
    decisions and picks are the same on both engines. ``rule``: kept only if robust (else moves are
    plain interpolations); ``watch``: where refused and deviant peers are counted; ``time``: the
    clock fetch deadlines are read on."""

    def __init__(self, peers: Iterable[int], settings: GossipSettings, seed: int = 0,
                 rule: AggregationRule | None = None, watch: PeerWatch | None = None, time: Clock = SYSTEM):
        self.settings = settings
        self.rule = rule if rule is not None and rule.robust else None
        self.watch = watch if watch is not None else PeerWatch()
        self.time = time
        self.rng = random.Random(seed)
        self.scores = PeerScores(sorted(peers), self.rng)
        self.clock = 0.0  # dpwa's clock: steps trained, interpolated with the peers'
        self.fetch: Fetch | None = None  # the fetch started and not judged yet
        self.latest: dict[int, torch.Tensor] = {}  # with a robust rule: each peer's latest model pulled
        self.merged = self.failed = 0  # fetches merged and failed, in all
        self._tallied = (0, 0)  # ``merged`` and ``failed`` at the last ``tally``

    def start_step(self, step_seconds: float, send: Callable[[Fetch], object] | None = None) -> Fetch | None:
        """Before a local step that takes about ``step_seconds``: with probability
        ``fetch_probability`` (one draw of the node's stream, then ``PeerScores.pick``), start
        fetching a peer, unless a fetch is still pending or every peer sits out. A fresh fetch asks
        the peer to hold it for ``step_seconds``, at most half the timeout. ``send``: how the engine
        carries a fetch (called with it; if it raises, the fetch never started and is forgotten).
        The fetch started, or None."""
        settings = self.settings
        if self.fetch is not None or not self.scores.score or self.rng.random() >= settings.fetch_probability:
            return None
        peer = self.scores.pick()
        if peer is None:
            return None
        now = self.time.monotonic()
        wait = min(step_seconds, settings.timeout / 2) if settings.fresh else 0.0
        self.fetch = Fetch(peer, wait, now, now + settings.timeout)
        if send is not None:
            try:
                send(self.fetch)
            except BaseException:
                self.cancel()
                raise
        return self.fetch

    def trained(self, steps: float = 1.0) -> None:
        """``steps`` local steps done: dpwa's clock counts them."""
        self.clock += steps

    def publish(self, state: torch.Tensor, loss: float | None, steps: float = 1.0,
                forge: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
        """After ``steps`` local steps (``trained``; 0: none since the last publish), what the node
        publishes: its ``state`` (a bad node's: what its ``forge(state, steps trained)`` makes of
        it) and the ``meta`` that goes with it, its ``loss`` after them."""
        self.trained(steps)
        return (state if forge is None else forge(state, int(self.clock))), self.meta(loss)

    def meta(self, loss: float | None) -> dict[str, float | None]:
        """What the node publishes with its state (read back by ``Reply.read``): dpwa's clock and
        its loss (None before any step counts as 0; a loss that is not finite, a diverged node's,
        is published as None: peers take nothing from it)."""
        loss = float(loss or 0.0)
        return {"clock": self.clock, "loss": loss if math.isfinite(loss) else None}

    def judge(self, reply: Reply | None, own_loss: float | None) -> Verdict:
        """The pending fetch ended with ``reply`` (None: no answer in time, or the peer gone);
        ``own_loss`` is the node's loss after its step (a loss that is not finite takes all of the
        peer). Scores the peer, counts what the watch saw, and for a merged reply moves dpwa's clock
        by the factor the model moves by (``move`` then moves the model)."""
        fetch = self.fetch
        if fetch is None:
            raise RuntimeError("judge called with no fetch pending")
        self.fetch = None
        peer = fetch.peer
        if reply is None:
            self.scores.no_answer(peer)
            return self._failed(peer, NO_ANSWER)
        if reply.problem is not None or reply.clock is None:
            return self._refused(peer, reply.problem or "its clock is not a number")
        if reply.loss is None or not math.isfinite(reply.loss):
            self.scores.failure(peer)  # a diverged peer: nothing taken, but not refused (an honest failure)
            return self._failed(peer, DIVERGED)
        problem = next(filter(None, map(refusal, reply.tensors)), None)
        if problem is not None:  # NaN or Inf: refused before any rule sees it
            return self._refused(peer, problem)
        self.watch.heard(peer)
        self.scores.success(peer)
        own = float(own_loss or 0.0)
        factor = 1.0 if not math.isfinite(own) else \
            interpolation_factor(self.settings, self.clock, reply.clock, own, reply.loss)
        self.clock = factor * reply.clock + (1 - factor) * self.clock
        self.merged += 1
        return Verdict(peer, MERGED, factor, reply.tensors)

    def adopt(self, reply: Reply) -> str | None:
        """A node joining a group that trains takes a peer's ``reply`` whole (its model, by the
        engine, and here dpwa's clock): None, or why it cannot (as ``judge`` refuses)."""
        problem = reply.problem or (None if reply.clock is not None else "its clock is not a number") or \
            (None if reply.loss is not None and math.isfinite(reply.loss) else "its loss is not finite") or \
            next(filter(None, map(refusal, reply.tensors)), None)
        if problem is None:
            self.clock = reply.clock
        return problem

    def cancel(self) -> None:
        """Forget the pending fetch without judging it: the engine could not carry it out."""
        self.fetch = None

    def take(self, reply: Reply | None, own_loss: float | None, own: torch.Tensor) -> tuple[Verdict, float]:
        """The pending fetch ended with ``reply``: ``judge`` it, then ``move`` the node's model
        ``own`` as the verdict says. The verdict, and the seconds the move took on the node's clock."""
        verdict = self.judge(reply, own_loss)
        started = self.time.monotonic()
        self.move(verdict, own)
        return verdict, self.time.monotonic() - started

    def move(self, verdict: Verdict, own: torch.Tensor) -> None:
        """After ``verdict`` (nothing unless merged): move the node's model ``own`` (its whole state
        vector, cut as the verdict's ``pulled`` is) in place by the verdict's factor, toward the
        peer's state or, with a robust rule, toward the rule's aggregate (``move_robustly``)."""
        if not verdict.merged:
            return
        pulled = verdict.pulled
        if self.rule is not None:
            self.move_robustly(own, torch.cat([t.reshape(-1) for t in pulled]).to(own.device), verdict.peer,
                               verdict.factor)
            return
        with torch.no_grad():
            for target, source in zip(own.split([t.numel() for t in pulled]), pulled):
                target.lerp_(source.to(target.device), verdict.factor)

    def move_robustly(self, own: torch.Tensor, pulled: torch.Tensor, peer: int, factor: float) -> None:
        """With a robust rule, after a merged verdict: keep ``pulled`` (the node's own copy) as
        ``peer``'s latest model and move ``own`` in place by ``factor`` toward the rule's aggregate
        of the node's model and each peer's latest (``robust_target``)."""
        self.latest[peer] = pulled
        with torch.no_grad():
            own.lerp_(robust_target(self.rule, own.detach(), self.latest, peer, self.watch, len(self.scores.score)),
                      factor)

    def tally(self) -> tuple[int, int]:
        """Fetches merged and failed since the last tally (one iteration's record)."""
        merged, failed = self.merged - self._tallied[0], self.failed - self._tallied[1]
        self._tallied = (self.merged, self.failed)
        return merged, failed

    def columns(self) -> dict[str, float]:
        """Gossip's columns of an iteration's record in the run log: fetches merged and failed since
        the last call (``tally``), and dpwa's clock."""
        merged, failed = self.tally()
        return {"merged": merged, "failed": failed, "clock": self.clock}

    def _refused(self, peer: int, problem: str) -> Verdict:
        self.watch.refused(peer, problem)
        self.scores.failure(peer)
        return self._failed(peer, REFUSED)

    def _failed(self, peer: int, outcome: str) -> Verdict:
        self.failed += 1
        return Verdict(peer, outcome)
