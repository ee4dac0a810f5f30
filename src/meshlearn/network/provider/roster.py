"""A task's providers as one of them knows them at the task's end (``finish.Finisher``)."""

from __future__ import annotations

import logging
import threading

from meshlearn.errors import TaskFailed
from meshlearn.network.task.spec import TaskSpec

log = logging.getLogger(__name__)


class Roster:
    """The task's providers (with those that joined while it trains) and where they are, which
    are shut out of the task for good (``exclude``: a revoked key), and whether one of them refused
    this provider's key (it was revoked itself: ``check_admitted``). Thread-safe."""

    def __init__(self, spec: TaskSpec, index: int):
        self.spec = spec
        self.index = index  # this provider's
        self.ids = [p.id for p in spec.peers]
        self.excluded: set[int] = set()  # providers shut out of the task (revoked keys): never followed
        self.refused_by: str | None = None  # a provider that refused this one's key: it was revoked
        self._lock = threading.Lock()

    def add(self, spec: TaskSpec) -> None:
        """The task's providers with one that joined while it trains (the last of ``spec.peers``)."""
        with self._lock:
            self.spec = spec
            self.ids = [p.id for p in spec.peers]

    def exclude(self, index: int) -> bool:
        """Leave provider ``index`` out for good; whether that is news."""
        with self._lock:
            if index in self.excluded or index == self.index:
                return False
            self.excluded.add(index)
        return True

    def address(self, index: int) -> str:
        """Where provider ``index``'s server is reached (``HOST:PORT@KEY``)."""
        return self.spec.peers[index].address

    def note_refusal(self, index: int) -> None:
        """Provider ``index`` refused this provider's key: it was revoked."""
        self.refused_by = self.ids[index]
        log.warning("task %s: provider %s refuses this provider's key (revoked)", self.spec.task_id, self.ids[index])

    def check_admitted(self) -> None:
        """Raise TaskFailed once another provider refused this one's key: this provider was
        revoked, and leaves the task to the others (it must not lead them, nor be followed)."""
        if self.refused_by is not None:
            raise TaskFailed(f"provider {self.refused_by} refuses this provider's key (it was revoked): the task "
                             "goes on without it")
