"""What asynchronous algorithms of the batched engine share: modelled time as an event queue (and
a clock that reads it, for the state machines shared with the process engine), and nodes' steps
computed together, lazily."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

from meshlearn.clock import Clock


class EventQueue:
    """Events in the order of their modelled time; events at the same time in the order pushed
    (so a run repeats exactly)."""

    def __init__(self) -> None:
        self._heap: list = []
        self._order = itertools.count()

    def push(self, time: float, *event: Any) -> None:
        heapq.heappush(self._heap, (time, next(self._order), event))

    def pop(self) -> tuple[float, tuple]:
        """(time, event) of the next event."""
        time, _, event = heapq.heappop(self._heap)
        return time, event

    def __bool__(self) -> bool:
        return bool(self._heap)


class ModelledClock(Clock):
    """A clock that reads the modelled time the event queue has reached (set ``now`` as events are taken)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


class PendingSteps:
    """Nodes whose local steps have started but are not computed yet. A node's step reads and
    writes only its own row, so it can be computed any time before its result is first needed:
    then every pending one is computed in one call of ``train`` (``steps`` times, for nodes that
    take several steps at a start)."""

    def __init__(self, train: Callable[[list[int]], dict[int, float]], steps: int = 1):
        self.train = train
        self.steps = steps
        self._pending: set[int] = set()

    def start(self, rank: int) -> None:
        self._pending.add(rank)

    def settle(self, rank: int) -> dict[int, list[float]]:
        """Make sure ``rank``'s started steps are computed; the losses of every node computed now."""
        if rank not in self._pending:
            return {}
        group = sorted(self._pending)
        self._pending.clear()
        losses: dict[int, list[float]] = {member: [] for member in group}
        for _ in range(self.steps):
            for member, loss in self.train(group).items():
                losses[member].append(loss)
        return losses
