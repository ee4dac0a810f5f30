"""Who leads a group: the lowest-ranked member still alive, agreed on without a vote.

Every member runs the same rule over the same ranks, so when the leader dies the others settle
on its successor by themselves. Whether a member lives is asked with a ``ping`` the owner
supplies (over the engine's hub, or over the network's RPC). Pings happen outside the lock: a
thread asking who leads never waits behind one that is pinging a dead member.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from meshlearn.clock import SYSTEM, Clock


class Election:
    """The group's view of its leader, as this member sees it. Thread-safe."""

    def __init__(self, members: Iterable[int], me: int, ping: Callable[[int], bool],
                 on_dead: Callable[[int], None] | None = None):
        self.members = sorted(members)
        self.me = me
        self._ping = ping
        self._on_dead = on_dead
        self._dead: set[int] = set()
        self._leader = self.members[0]
        self._lock = threading.Lock()
        self._wake = threading.Event()

    @property
    def leader(self) -> int:
        """The member currently taken to lead."""
        with self._lock:
            return self._leader

    @property
    def dead(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._dead)

    def is_dead(self, rank: int) -> bool:
        with self._lock:
            return rank in self._dead

    def mark_dead(self, rank: int) -> bool:
        """Record that ``rank`` is gone (never this member); returns whether that is news."""
        if rank == self.me:
            return False
        with self._lock:
            if rank in self._dead:
                return False
            self._dead.add(rank)
        if self._on_dead is not None:
            self._on_dead(rank)
        return True

    def add(self, rank: int) -> None:
        """A member that joined the group while it runs (it leads only once every lower rank is gone)."""
        with self._lock:
            if rank not in self.members:
                self.members = sorted([*self.members, rank])

    def resolve(self) -> int:
        """Find the leader again: the lowest-ranked member not known dead that answers a ping
        (members found silent are marked dead); this member if none below it answers."""
        for rank in self.members:
            if rank == self.me:
                break
            if self.is_dead(rank):
                continue
            if self._ping(rank):
                return self._set(rank)
            self.mark_dead(rank)
        return self._set(self.me)

    def watch(self, stop: threading.Event, interval: float, clock: Clock = SYSTEM) -> None:
        """Until ``stop`` is set (then ``poke``), ping the leader every ``interval`` seconds, or at
        once when poked: a silent leader is marked dead and its successor found. A member that
        watches is known by the leader to live, and learns of a dead leader between its own calls."""
        while not stop.is_set():
            clock.wait(self._wake, interval)
            self._wake.clear()
            leader = self.leader
            if not stop.is_set() and leader != self.me and not self._ping(leader):
                self.mark_dead(leader)
                self.resolve()

    def poke(self) -> None:
        """Make ``watch`` look at the leader now (someone suspects it is gone, or it should stop)."""
        self._wake.set()

    def _set(self, rank: int) -> int:
        with self._lock:
            self._leader = rank
        return rank
