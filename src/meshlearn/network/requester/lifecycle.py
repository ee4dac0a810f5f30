"""Where a requester's task stands, from its plan to its release: a pure state machine.

A task is planned (the data read, its memory estimated), its providers claimed, then assigned
(every provider prepares it; one that cannot is left out and the task assigned again: another
attempt), started, and followed while it runs (growing, while a newcomer is taken in). Once its
result is in it settles (its providers end their part) and is done; a task that fails, or is
interrupted, fails or is cancelled from wherever it was. A task that ever held providers is then
released to the bootstrap (only such a task). Moves go along ``NEXT`` only; any other raises.

No sockets and no threads: the requester (``service.Requester``) moves it as its collaborators
work, and asks it where that decides what happens (whether there are providers to cancel and a
task to release, whether the result is in). Each move is stamped by the clock, so a test drives
it with a ``FakeClock``.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from meshlearn.clock import SYSTEM, Clock

log = logging.getLogger(__name__)


class TaskStage(str, enum.Enum):
    """Where a requester's task stands."""

    PLANNING = "planning"  # the data read, the task's memory estimated; nothing asked of the network yet
    CLAIMING = "claiming"  # free providers looked at, waited for, claimed at the bootstrap
    CLAIMED = "claimed"  # providers are the task's: its data served to them
    ASSIGNING = "assigning"  # an attempt: every provider given the task, waited for until ready
    STARTED = "started"  # every provider told to start
    RUNNING = "running"  # followed until a provider holds the result
    GROWING = "growing"  # a newcomer claimed while the task runs, being taken in
    SETTLING = "settling"  # the result is in: the providers end their part
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"  # interrupted on the requester's side (Ctrl-C)
    RELEASED = "released"  # the bootstrap told that the task ended: its providers are free


_ENDS = frozenset({TaskStage.FAILED, TaskStage.CANCELLED})
ENDED = frozenset({TaskStage.DONE, *_ENDS})  # the task is over; only its release is left
NEXT: dict[TaskStage, frozenset[TaskStage]] = {
    TaskStage.PLANNING: frozenset({TaskStage.CLAIMING, *_ENDS}),
    TaskStage.CLAIMING: frozenset({TaskStage.CLAIMED, *_ENDS}),
    TaskStage.CLAIMED: frozenset({TaskStage.ASSIGNING, *_ENDS}),
    TaskStage.ASSIGNING: frozenset({TaskStage.ASSIGNING, TaskStage.STARTED, *_ENDS}),  # again: a new attempt
    TaskStage.STARTED: frozenset({TaskStage.RUNNING, *_ENDS}),
    TaskStage.RUNNING: frozenset({TaskStage.GROWING, TaskStage.SETTLING, *_ENDS}),
    TaskStage.GROWING: frozenset({TaskStage.RUNNING, *_ENDS}),
    TaskStage.SETTLING: frozenset({TaskStage.DONE, *_ENDS}),
    TaskStage.DONE: frozenset({TaskStage.RELEASED}),
    TaskStage.FAILED: frozenset({TaskStage.RELEASED}),
    TaskStage.CANCELLED: frozenset({TaskStage.RELEASED}),
    TaskStage.RELEASED: frozenset(),
}
# the stages in which the task holds providers the bootstrap gave it (to cancel and release if it fails)
HOLDING = frozenset({TaskStage.CLAIMED, TaskStage.ASSIGNING, TaskStage.STARTED, TaskStage.RUNNING,
                     TaskStage.GROWING, TaskStage.SETTLING})


@dataclass(frozen=True)
class Entry:
    """One move: the stage entered, when (the clock's monotonic seconds), and why (may be empty)."""

    stage: TaskStage
    at: float
    why: str = ""


class TaskLifecycle:
    """One task's stages as it moves along ``NEXT``, each entry stamped by ``clock``."""

    def __init__(self, task_id: str, clock: Clock = SYSTEM):
        self.task_id = task_id
        self.clock = clock
        self.history: list[Entry] = [Entry(TaskStage.PLANNING, clock.monotonic())]

    @property
    def stage(self) -> TaskStage:
        """The stage the task is in now."""
        return self.history[-1].stage

    def move(self, to: TaskStage, why: str = "") -> None:
        """Enter ``to`` (``why``: what made it, for the record); RuntimeError where ``NEXT`` has no such move."""
        if to not in NEXT[self.stage]:
            allowed = ", ".join(sorted(s.value for s in NEXT[self.stage])) or "none: it is over"
            raise RuntimeError(f"task {self.task_id}: no move from {self.stage.value} to {to.value} "
                               f"(allowed: {allowed})")
        if to is TaskStage.RELEASED and not self.holds_providers:
            raise RuntimeError(f"task {self.task_id}: nothing to release: it never held providers")
        self.history.append(Entry(to, self.clock.monotonic(), why))
        log.info("task %s: %s%s", self.task_id, to.value, f" ({why})" if why else "")

    def fail(self, why: str, cancelled: bool = False) -> None:
        """The task failed (or, ``cancelled``, was interrupted) in the stage it is in, because of ``why``."""
        self.move(TaskStage.CANCELLED if cancelled else TaskStage.FAILED, why)

    @property
    def holds_providers(self) -> bool:
        """Whether providers are the task's now: claimed, or its end not yet told to the bootstrap."""
        if self.stage in HOLDING:
            return True
        return self.stage in ENDED and self.history[-2].stage in HOLDING  # ended while it held them

    @property
    def result_in(self) -> bool:
        """Whether the task's result is fetched (a provider that goes from now on left; it was not lost)."""
        return any(e.stage is TaskStage.SETTLING for e in self.history)

    @property
    def attempts(self) -> int:
        """How many times the task was assigned (1: it started on the providers first claimed)."""
        return sum(e.stage is TaskStage.ASSIGNING for e in self.history)

    @property
    def failure(self) -> str | None:
        """Why the task failed or was cancelled; None while it has not."""
        ended = [e for e in self.history if e.stage in _ENDS]
        return ended[-1].why if ended else None

    def entered(self, stage: TaskStage) -> float | None:
        """When the task last entered ``stage`` (monotonic seconds); None if it never did."""
        times = [e.at for e in self.history if e.stage is stage]
        return times[-1] if times else None

    def seconds_in(self, stage: TaskStage) -> float:
        """How long the task has been in ``stage`` in all (every stretch, up to now for the current one)."""
        ends = [e.at for e in self.history[1:]] + [self.clock.monotonic()]
        return sum(end - e.at for e, end in zip(self.history, ends) if e.stage is stage)
