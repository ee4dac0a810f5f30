"""The leader's book: every member's latest model and contribution, and when a push may be answered.

CloudMesh's design, finished. A member pushes its model every aggregation cycle and gets the
aggregate back at once; only the very first cycle waits (up to the peer timeout) for everyone, so
that all start from one model, and final models wait for every member's final model (or its
loss), so that all end with the same one. A member silent for longer than the peer timeout is
counted lost and left out of the aggregate, so a dead member never blocks the leader. How much a
model counts is a weighting from ``meshlearn.aggregation.weights`` (by default sample- and
staleness-weighted), and the aggregate is an ``aggregation`` rule (by default the mean) over the
leader's own model (first: the reference of self-centred rules) and the others' latest. A model
holding NaN or Inf is refused (the member's earlier model stays) and counted in ``watch``.

Pushes that say their cycle (the member's iteration) are taken once per cycle: the same cycle
again is the member sending it again (its first copy, or the answer, may have been lost on the
way) and changes nothing but the member's last sign of life; an older cycle than the member's
latest is refused (and counted in ``watch``).

Synchronous (``sync``, the CloudMesh report's code): a push of cycle c is answered once every
member not lost has pushed cycle c (or a later one, or its final model), and every member of the
cycle gets the same aggregate, made once, of the members' cycle-c models (with ``drawn``, of
those drawn for the cycle: FedAvg's fraction). A member lost (silent for the peer timeout) is no
longer waited for; staleness means nothing there (every model is of the same cycle), so the
staleness weighting weighs by samples. ``rounds`` records how many models each cycle's aggregate
took.

A member may join while the group trains (``join``, a network task's newcomer): asynchronous, it
takes the aggregate of the latest models and the slowest training member's cycle; synchronous, the
aggregate of the newest cycle every member has pushed, and from the next cycle on every cycle
waits for it too (with ``drawn``, it is drawn among the members from then on). Either way it
trains on from the cycle after the one it was given, as the others do.

Nothing here blocks except ``wait``, which only the leader's own training thread calls: pushes
from other members are recorded by the serving thread of the leader's endpoint, and the ones that
must wait are held there, not parked in threads.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from dataclasses import dataclass
from typing import Callable, Collection, Literal

import torch

from meshlearn.aggregation import (
    AggregationRule,
    by_samples,
    by_staleness,
    equal,
    get_rule,
)
from meshlearn.aggregation.suspects import PeerWatch, refusal
from meshlearn.clock import SYSTEM, Clock
from meshlearn.definitions.fedavg import participants
from meshlearn.definitions.settings import LeaderSettings

log = logging.getLogger(__name__)
Weighting = Literal["staleness", "samples", "equal"]
DIVERGED_FACTOR = 10.0  # a final model whose last steps' loss is this many times the median's ...
DIVERGED_MARGIN = 0.1  # ... plus this is left out of the final aggregate
KEPT_ROUNDS = 2  # sync: the aggregates of this many latest cycles are kept (a lost answer's push comes again)


@dataclass
class Contribution:
    """What one member gave: samples in its shard, models pushed, and how it stands."""

    samples: int = 0
    updates: int = 0
    finished: bool = False
    lost: bool = False
    last_seen: float = 0.0
    stored_at: int = 0  # the book's clock when its latest model came
    waiting_final: bool = False  # its latest push was final and waits for the others
    cycle: int = -1  # the cycle of its latest push, where pushes say theirs
    loss: float | None = None  # the mean loss of the local steps before its latest push, where it says it


@dataclass(frozen=True)
class Push:
    """What a member gives the leader after its local steps of one cycle (its iteration): its model
    (a flat state vector), its shard's samples, whether the model is its final one, and the mean
    loss of the local steps that made it (None where it does not say; inf where not finite)."""

    state: torch.Tensor
    samples: int
    cycle: int
    final: bool
    loss: float | None = None

    @classmethod
    def after(cls, state: torch.Tensor, samples: int, iteration: int, iterations: int,
              loss: float | None = None) -> Push:
        """The push a member makes after the local steps of ``iteration`` (of ``iterations``: the
        last one's is final), whose mean loss was ``loss``."""
        if loss is not None and not math.isfinite(loss):
            loss = math.inf
        return cls(state, samples, iteration, iteration + 1 == iterations, loss)


def drawn_of(settings: LeaderSettings, seed: int) -> Callable[[int, list[int]], list[int]] | None:
    """With ``fraction`` below 1, who of a group (every member, sorted) is drawn for a cycle: ``(cycle,
    group) -> members``, seeded with ``seed`` (``fedavg.participants``: every member draws the same);
    None where every member always is."""
    if settings.fraction == 1:
        return None
    return lambda cycle, group: [group[i] for i in participants(seed, cycle, len(group), settings.drawn(len(group)))]


class LeaderState:
    """The leader's view of the group, by member rank (thread-safe)."""

    def __init__(self, members: list[int], me: int, peer_timeout: float, first_barrier: bool,
                 weighting: Weighting = "staleness", rule: str | AggregationRule = "mean", clock: Clock = SYSTEM,
                 watch: PeerWatch | None = None, sync: bool = False,
                 drawn: Callable[[int, list[int]], Collection[int]] | None = None,
                 noise: Callable[[torch.Tensor, int], torch.Tensor] | None = None):
        self.me = me
        self.noise = noise  # sync: central DP's noise on each cycle's aggregate (of that many models), made once
        self.sync = sync
        self.drawn = drawn  # sync: (cycle, group) -> those whose models make its aggregate (None: every one)
        self.group = sorted(members)  # every member, lost or not: whom ``drawn`` draws from
        self.taken_over = False  # a book a new leader took over on fail-over (it starts empty)
        self.rounds: dict[int, int] = {}  # sync: cycle -> the models its aggregate took
        self._round_answers: dict[int, torch.Tensor] = {}
        self.peer_timeout = peer_timeout
        self.weighting = weighting
        self.rule = get_rule(rule) if isinstance(rule, str) else rule
        self.watch = watch if watch is not None else PeerWatch()
        self.clock = clock
        self.latest: dict[int, torch.Tensor] = {}
        self.left_out_final: list[int] = []  # members whose final model diverged: not in the final aggregate
        self.pushes = 0  # models received so far: the staleness clock
        self._observed = 0  # ``pushes`` when the members' models were last judged
        now = clock.monotonic()
        self.contributions = {i: Contribution(last_seen=now) for i in members}
        self._started = now
        self._first_open = first_barrier
        self._cond = threading.Condition()

    @classmethod
    def of(cls, settings: LeaderSettings, members: list[int], me: int, seed: int, peer_timeout: float, *,
           start: bool = True, group: list[int] | None = None, rule: str | AggregationRule = "mean",
           watch: PeerWatch | None = None, clock: Clock = SYSTEM) -> LeaderState:
        """The book a leader keeps under ``settings``, of ``members``. Only a book that starts the
        run (``start``; not one taken over on fail-over) waits for everyone in the first cycle,
        where ``first_barrier``. With ``fraction`` below 1, each synchronous cycle's aggregate takes
        the models of the members of ``group`` (all of them, sorted; by default ``members``) drawn
        for it from ``seed`` (``fedavg.participants``: every member draws the same)."""
        book = cls(members, me, peer_timeout, start and settings.first_barrier, settings.weighting, rule=rule,
                   clock=clock, watch=watch, sync=settings.sync, drawn=drawn_of(settings, seed))
        book.group = sorted(members if group is None else group)
        book.taken_over = not start
        return book

    # --- what members do ----------------------------------------------------------------------

    def touch(self, member: int) -> None:
        """A sign of life from ``member`` (a push or a ping); nothing from one the book does not count
        (a newcomer pinging before it joined is not waited for)."""
        with self._cond:
            if member in self.contributions:
                self.contributions[member].last_seen = self.clock.monotonic()

    def mark_lost(self, member: int) -> None:
        with self._cond:
            self._member(member).lost = True
            self._cond.notify_all()

    def submit(self, member: int, state: torch.Tensor, samples: int, final: bool, copy: bool = True,
               updates: int | None = None, cycle: int | None = None, loss: float | None = None) -> bool:
        """Record ``member``'s latest model (a flat state vector); ``updates`` says how many models
        it has made in all, where those did not all come here (else this one is counted). With
        ``cycle``, a push of the member's latest cycle again is the same push sent again (nothing
        new is recorded) and one of an older cycle is refused. ``loss``: the mean loss of the
        local steps that made this model (a final one that diverged is left out of the final
        aggregate). False for a refused push, else True."""
        with self._cond:
            contribution = self._member(member)
            if cycle is not None and cycle <= contribution.cycle:
                return self._again(member, contribution, cycle)
            if cycle is not None:
                contribution.cycle = cycle
            contribution.samples = samples
            contribution.loss = loss
            contribution.updates = contribution.updates + 1 if updates is None else updates
            contribution.finished = contribution.finished or final
            contribution.waiting_final = final
            contribution.lost = False
            contribution.last_seen = self.clock.monotonic()
            self._cond.notify_all()
            problem = refusal(state)
            if problem is not None:
                self.watch.refused(member, problem)
                return True
            self.watch.heard(member)
            self.latest[member] = state.detach().to("cpu", copy=True) if copy else state
            self.pushes += 1
            contribution.stored_at = self.pushes
            self._cond.notify_all()
            return True

    def take(self, member: int, push: Push, copy: bool = True) -> bool:
        """Record ``member``'s ``push`` (as ``submit``; False for a refused one)."""
        return self.submit(member, push.state, push.samples, push.final, copy=copy, cycle=push.cycle, loss=push.loss)

    # --- when answers may go ------------------------------------------------------------------

    def first_deadline(self) -> float | None:
        """When (on the book's clock) the first cycle stops waiting for latecomers; None where it
        does not wait, or no longer does."""
        with self._cond:
            return self._started + self.peer_timeout if self._first_open else None

    def release(self, held: list[int]) -> dict[int, torch.Tensor]:
        """The answers to those of the ``held`` pushes (by member, in their order) that may have
        theirs now: the aggregate, made once for all of them (sync: each its cycle's)."""
        with self._cond:
            ready = [m for m in held if self._can_answer(m)]
            if self.sync or not ready:
                return {m: self._answer_for(m) for m in ready}
            aggregate = self._aggregate()
            return {m: aggregate for m in ready}

    def wait(self, member: int, poll: float = 0.05,
             give_up: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """Block until ``member``'s push may be answered, then return the aggregate (the leader's
        own training thread only); None as soon as ``give_up()`` says so (asked every ``poll``)."""
        with self._cond:
            while not self._can_answer(member):
                if give_up is not None and give_up():
                    return None
                self._cond.wait(timeout=poll)
            return self._answer_for(member)

    def ready(self, member: int) -> bool:
        """Whether ``member``'s latest push may be answered now (secure aggregation answers it itself)."""
        with self._cond:
            return self._can_answer(member)

    def heard_lately(self, member: int) -> bool:
        """Whether ``member`` was heard from within the peer timeout and is not lost (a finished member
        is never counted lost, but one silent that long is gone all the same)."""
        with self._cond:
            contribution = self.contributions.get(member)
            return contribution is not None and not self.is_lost(member) and \
                self.clock.monotonic() - contribution.last_seen <= self.peer_timeout

    def is_lost(self, member: int) -> bool:
        """Whether ``member`` is lost (silent for the peer timeout, or marked so)."""
        with self._cond:
            self._sweep()
            contribution = self.contributions.get(member)
            return contribution is None or contribution.lost

    def aggregate(self) -> torch.Tensor:
        """The aggregate of the latest models of every member not lost."""
        with self._cond:
            return self._aggregate()

    def join(self, member: int, samples: int, own: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """Count ``member`` (with ``samples`` in its shard) a member from now on (see the module):
        the model it starts from and the cycle that model is of (-1: before any, ``own``, the
        leader's model, which every member starts from too). None: not yet, the book was taken
        over on fail-over and some member still training has not pushed to it (it does not know
        where the group is)."""
        with self._cond:
            self._sweep()
            if self.taken_over and any(c.cycle < 0 and not (c.lost or c.finished) and m != member
                                       for m, c in self.contributions.items()):
                return None
            cycle = self._pushed_by_all() if self.sync else self.group_cycle()
            contribution = self._member(member)
            contribution.samples, contribution.lost = samples, False
            if member not in self.group:
                self.group = sorted({*self.group, member})
            if cycle < 0:
                return own.detach().to("cpu", copy=True), -1
            if not self.sync:
                return self._aggregate(), cycle
            contribution.cycle = max(contribution.cycle, cycle)  # the cycles up to it do not wait for it
            return self._cycle_answer(cycle), cycle

    def _pushed_by_all(self) -> int:
        """Sync: the newest cycle every member not lost (nor finished) has pushed, -1 before any."""
        self._sweep()
        cycles = [c.cycle for c in self.contributions.values() if not (c.lost or c.finished)]
        return min(cycles, default=-1)

    def group_cycle(self) -> int:
        """The cycle the group is at, for a member joining it: the oldest latest cycle of the members
        still training (members run at their own pace, the leader often ahead; a newcomer that
        starts where the slowest is trains as long as it), -1 before any push."""
        with self._cond:  # (re-entrant: ``join`` holds it)
            self._sweep()
            training = [c.cycle for c in self.contributions.values() if c.cycle >= 0 and not (c.finished or c.lost)]
            return min(training, default=max((c.cycle for c in self.contributions.values()), default=-1))

    def all_final(self) -> bool:
        """Whether every member has pushed its final model or is lost."""
        with self._cond:
            self._sweep()
            return all(c.finished or c.lost for c in self.contributions.values())

    def has_final(self, member: int) -> bool:
        with self._cond:
            return member in self.contributions and self.contributions[member].finished

    def report(self, names: list[str]) -> dict[str, dict]:
        """Per-member contribution, by member name (``names[rank]``)."""
        with self._cond:
            self._sweep()
            return {names[i]: {"samples": c.samples, "updates": c.updates,
                               "status": "lost" if c.lost else ("finished" if c.finished else "running")}
                    for i, c in sorted(self.contributions.items())}

    # --- inside the lock ------------------------------------------------------------------------

    def _again(self, member: int, contribution: Contribution, cycle: int) -> bool:
        """A push of a cycle already recorded: the latest one sent again (True), or an older one (False)."""
        if cycle == contribution.cycle:
            contribution.last_seen = self.clock.monotonic()
            contribution.lost = False
            return True
        self.watch.refused(member, f"a push of cycle {cycle}, older than its cycle {contribution.cycle}")
        return False

    def _member(self, member: int) -> Contribution:
        return self.contributions.setdefault(member, Contribution(last_seen=self.clock.monotonic()))

    def _sweep(self) -> None:
        now = self.clock.monotonic()
        for member, c in self.contributions.items():
            if member != self.me and not c.finished and now - c.last_seen > self.peer_timeout:
                c.lost = True

    def _can_answer(self, member: int) -> bool:
        self._sweep()
        contribution = self.contributions.get(member)
        if contribution is not None and contribution.waiting_final:
            return all(c.finished or c.lost for c in self.contributions.values())
        if self.sync and contribution is not None:
            cycle = contribution.cycle
            return cycle in self._round_answers or all(
                c.lost or c.finished or c.cycle >= cycle for c in self.contributions.values())
        if self._first_open:
            everyone_in = all(i in self.latest or c.lost for i, c in self.contributions.items())
            if not everyone_in and self.clock.monotonic() < self._started + self.peer_timeout:
                return False
            self._first_open = False
        return True

    def _answer_for(self, member: int) -> torch.Tensor:
        contribution = self.contributions.get(member)
        if not self.sync or contribution is None or (contribution.waiting_final and self.noise is None):
            return self._aggregate()
        return self._cycle_answer(contribution.cycle)  # (noised: the final aggregate too, once)

    def _cycle_answer(self, cycle: int) -> torch.Tensor:
        """Sync: cycle ``cycle``'s aggregate, made once (while no member has pushed a later cycle)."""
        if cycle not in self._round_answers and self.noise is not None and self._round_answers \
                and cycle < max(self._round_answers):  # noised once only: an old cycle gets the newest aggregate
            return self._round_answers[max(self._round_answers)]
        if cycle not in self._round_answers:
            aggregate = self._aggregate(cycle)
            self._round_answers[cycle] = aggregate if self.noise is None else self.noise(aggregate, self.rounds[cycle])
            for old in sorted(self._round_answers)[:-KEPT_ROUNDS]:
                del self._round_answers[old]
        return self._round_answers[cycle]

    def _behind(self, member: int, count: int) -> float:
        """How many rounds of pushes ``member``'s latest model is behind. A finished member's final
        model is its last word and never grows stale: a straggler that trains on after the others
        finished is pulled to their models, not left to train alone (and the final aggregate,
        every member finished, weighs by samples)."""
        contribution = self.contributions[member]
        return 0.0 if contribution.finished or self.sync else (self.pushes - contribution.stored_at) / count

    def _diverged(self, members: list[int]) -> list[int]:
        """The members whose final model diverged in its last local steps: their loss is not finite,
        or above ``DIVERGED_FACTOR`` times the median of the final models' losses plus
        ``DIVERGED_MARGIN`` (at a high learning rate one member's last steps can spike, and the
        final aggregate, unlike the answers before it, is never trained on again). Never more than
        half of them; none where members did not say their loss."""
        losses = {i: self.contributions[i].loss for i in members if self.contributions[i].loss is not None}
        finite = [x for x in losses.values() if math.isfinite(x)]
        if not finite:
            return []
        limit = DIVERGED_FACTOR * statistics.median(finite) + DIVERGED_MARGIN
        diverged = [i for i, x in losses.items() if not math.isfinite(x) or x > limit]
        if diverged and 2 * len(diverged) < len(members) and diverged != self.left_out_final:
            self.left_out_final = diverged
            log.warning("the final aggregate leaves out the final model of member(s) %s: its last local steps "
                        "diverged (loss %s; the final models' median %.3g)", ", ".join(map(str, diverged)),
                        ", ".join(f"{losses[i]:.3g}" for i in diverged), statistics.median(finite))
        return diverged if 2 * len(diverged) < len(members) else []

    def _aggregate(self, cycle: int | None = None) -> torch.Tensor:
        """The aggregate of the latest models of the members not lost (``cycle``: a synchronous
        cycle's, of those drawn for it where any of them gave a model, recorded in ``rounds``)."""
        self._sweep()
        members = sorted((i for i in self.latest if not self.contributions[i].lost), key=lambda i: (i != self.me, i))
        if all(c.finished or c.lost for c in self.contributions.values()) and self.noise is None:  # the final one
            left_out = self._diverged(members)  # (not under central DP: it would choose by a member's own loss)
            members = [i for i in members if i not in left_out]
        elif cycle is not None and self.drawn is not None:
            drawn = set(self.drawn(cycle, self.group))
            members = [i for i in members if i in drawn] or members  # none of them: everyone's
        if cycle is not None:
            self.rounds[cycle] = len(members)
        samples = [self.contributions[i].samples for i in members]
        if self.weighting == "staleness":
            behind = [self._behind(i, len(members)) for i in members]
            weights = by_staleness(samples, behind)
        elif self.weighting == "samples":
            weights = by_samples(samples)
        else:
            weights = equal(len(members))
        models = torch.stack([self.latest[i] for i in members])
        aggregate = self.rule(models, weights)
        if self.rule.robust and members and members[0] == self.me and self._observed != self.pushes:
            self._observed = self.pushes  # each new set of models is judged once, not at every answer
            self.watch.observe(members[1:], models, aggregate)
        return aggregate
