"""One member's side of leader aggregation, as a state machine both engines drive (as ``LeaderState``
is the leader's book for both, and ``GossipState`` a gossiping node's decisions).

``LeaderMember`` holds what a member keeps between its cycles: the cycle it is in (its iteration),
the losses of its local steps since its last push, when it pushed (on an injected ``Clock``), and
how often in a row its push was refused on the way. Its events are short methods, which both
engines call in one order: ``trained`` (local steps done: their losses), ``pushing`` (a cycle's
steps are done: its push starts now), ``push`` (the ``Push`` it gives the leader: its model,
samples, cycle, whether it is final, the steps' mean loss), then ``answered`` (the leader's answer
came: the seconds it waited, its record's ``comm``; the next cycle starts). ``finished`` says when
it has pushed its last cycle.

A member waits for the leader's answer to every push, synchronous or not, and trains on from the
aggregate it answers with: when an answer may go (the first cycle's barrier, a synchronous cycle,
a final push) is the book's decision, not the member's. Where the leader never sees a member's
model (secure aggregation), the member says itself what its model weighs in a cycle's sum
(``weight``: by the weighting, and 0 where a fraction's draw, the book's own ``drawn_of``, left it
out).

Time is read from the injected clock: the process engine's member (``node.algorithms.leader``)
reads the real one, the batched engine's run (``batched.algorithms.leader``) a modelled one,
tests a ``FakeClock``. Carrying pushes and answers stays with the engines: the process engine
over its hub endpoint, following the election's fail-over (a push that finds no leader goes to
the next) and sending again a push refused on the way (after ``refused``), the batched engine as
events with modelled latencies (its members never fail).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshlearn.clock import SYSTEM, Clock
from meshlearn.definitions.leaderstate import Push, drawn_of
from meshlearn.definitions.settings import LeaderSettings

REFUSED_BACKOFF = 0.05  # seconds before sending again a push refused on the way, doubled at each refusal in a row ...
MAX_REFUSED_BACKOFF = 1.0  # ... up to this
LOSS_SAID_LIMIT = 1e30  # a push's loss says at most this (inf, a diverged member's, is no number on the wire)


class LeaderMember:
    """One member's side of leader aggregation (see the module): a member with ``samples`` in its
    shard that trains ``iterations`` cycles, from ``cycle`` (a newcomer's or a resumed run's first).
    ``settings``, ``seed`` and ``rank`` say what its model weighs where it says so itself (``weight``)."""

    def __init__(self, samples: int, iterations: int, clock: Clock = SYSTEM, cycle: int = 0,
                 settings: LeaderSettings | None = None, seed: int = 0, rank: int = 0):
        self.samples, self.iterations, self.clock = samples, iterations, clock
        self.cycle = cycle  # the cycle it is in: its iteration
        self.loss: float | None = None  # the mean loss of the local steps before its latest push
        self.pushed_at = 0.0  # when (on ``clock``) its latest push started
        self.refusals = 0  # times its latest push was refused on the way, in a row
        self._losses: list[float] = []  # its local steps' losses since its latest push
        self.rank = rank
        self._equal = settings is not None and settings.weighting == "equal"
        self._drawn: Callable[[int, list[int]], list[int]] | None = None if settings is None else \
            drawn_of(settings, seed)

    @property
    def finished(self) -> bool:
        """Whether it has pushed (and been answered) its last cycle."""
        return self.cycle >= self.iterations

    def trained(self, *losses: float | None) -> None:
        """Local steps done since its latest push: their ``losses`` (or their mean, where the engine
        has it already; None for steps that report none)."""
        for loss in losses:
            if loss is not None:
                self._losses.append(loss)

    def pushing(self, cycle: int | None = None) -> None:
        """Its local steps of ``cycle`` (by default the one it is in) are done: its push starts now.
        The push says the mean of their losses (None where none said one)."""
        if cycle is not None:
            self.cycle = cycle
        losses = self._losses
        self.loss = sum(losses) / len(losses) if losses else None
        losses.clear()
        self.pushed_at = self.clock.monotonic()
        self.refusals = 0

    def push(self, state: torch.Tensor) -> Push:
        """What it gives the leader for its cycle: ``state`` (its model as it sends it), its samples,
        the cycle, whether it is the last, and its steps' mean loss (not finite: inf)."""
        return Push.after(state, self.samples, self.cycle, self.iterations, self.loss)

    @staticmethod
    def fields(push: Push) -> dict[str, int | bool | float | None]:
        """What ``push`` says besides its model, as the wire carries it: its samples, whether it is
        final, its cycle and its loss (an inf loss said as ``LOSS_SAID_LIMIT``)."""
        loss = None if push.loss is None else min(push.loss, LOSS_SAID_LIMIT)
        return {"samples": push.samples, "final": push.final, "cycle": push.cycle, "loss": loss}

    def refused(self) -> float:
        """Its push was refused on the way (damaged): the seconds to wait before sending it again,
        ``REFUSED_BACKOFF`` doubled at each refusal in a row, at most ``MAX_REFUSED_BACKOFF``."""
        self.refusals += 1
        return min(MAX_REFUSED_BACKOFF, REFUSED_BACKOFF * 2 ** (self.refusals - 1))

    def answered(self) -> float:
        """The leader's answer to its push came (it trains on from the aggregate): the seconds it
        waited since ``pushing`` (its record's ``comm``); its next cycle starts."""
        self.cycle += 1
        return self.clock.monotonic() - self.pushed_at

    def weight(self, cycle: int, group: list[int]) -> float:
        """What its model weighs in ``cycle``'s sum of the ``group``'s (every member, sorted): its
        samples (1 where the weighting is equal), 0 where the fraction's draw for the cycle (the
        book's ``drawn_of``) left it out."""
        if self._drawn is not None and self.rank not in self._drawn(cycle, group):
            return 0.0
        return 1.0 if self._equal else float(self.samples)
