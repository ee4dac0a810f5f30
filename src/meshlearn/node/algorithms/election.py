"""Who leads a group: the lowest-ranked member still alive, agreed on without a vote.

Every member runs the same rule over the same ranks, so when the leader dies the others settle
on its successor by themselves. Whether a member lives is asked with a ``ping`` the owner
supplies (over the engine's hub, or over the network's RPC). Pings happen outside the lock: a
thread asking who leads never waits behind one that is pinging a dead member.

A member is given up in one of two ways. One that missed a ping is *suspected*: perhaps gone,
perhaps only slow (a busy machine answers late), so it is asked again, and taken back once it
answers (``revive``; it leads again if it is the lowest). ``watch`` asks one suspected member
below the leader each period, and a member told by a live peer that a suspected one leads asks it
at once (``recheck``). One shut out of the group (a revoked key) is *excluded* (``exclude``): that
is final, whatever it answers.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from meshlearn.clock import SYSTEM, Clock


class Election:
    """The group's view of its leader, as this member sees it. Thread-safe.

    ``on_dead(rank)`` is called when a member is first given up (suspected or excluded), and
    ``on_alive(rank)`` when a suspected one is taken back (the leader is already the new one then).
    """

    def __init__(self, members: Iterable[int], me: int, ping: Callable[[int], bool],
                 on_dead: Callable[[int], None] | None = None, on_alive: Callable[[int], None] | None = None):
        self.members = sorted(members)
        self.me = me
        self._ping = ping
        self._on_dead = on_dead
        self._on_alive = on_alive
        self._suspected: set[int] = set()
        self._excluded: set[int] = set()
        self._leader = self.members[0]
        self._asked = -1  # the suspected member ``watch`` asked last (the next one is asked next)
        self._lock = threading.Lock()
        self._wake = threading.Event()

    @property
    def leader(self) -> int:
        """The member currently taken to lead."""
        with self._lock:
            return self._leader

    @property
    def dead(self) -> frozenset[int]:
        """The members given up: suspected (revivable) or excluded (for good)."""
        with self._lock:
            return frozenset(self._suspected | self._excluded)

    @property
    def suspected(self) -> frozenset[int]:
        """The members given up after a missed ping, which are asked again."""
        with self._lock:
            return frozenset(self._suspected)

    @property
    def excluded(self) -> frozenset[int]:
        """The members shut out for good."""
        with self._lock:
            return frozenset(self._excluded)

    def is_dead(self, rank: int) -> bool:
        """Whether ``rank`` is given up (suspected or excluded): not followed now."""
        with self._lock:
            return rank in self._suspected or rank in self._excluded

    def mark_dead(self, rank: int) -> bool:
        """Suspect ``rank`` (never this member): it missed a ping or a call, and is not followed
        until it answers again. Returns whether that is news."""
        if rank == self.me:
            return False
        with self._lock:
            if rank in self._suspected or rank in self._excluded:
                return False
            self._suspected.add(rank)
        if self._on_dead is not None:
            self._on_dead(rank)
        return True

    def exclude(self, rank: int) -> bool:
        """Give ``rank`` up for good (it was shut out): never followed again, whatever it answers.
        Returns whether it was not given up before."""
        if rank == self.me:
            return False
        with self._lock:
            news = rank not in self._suspected and rank not in self._excluded
            self._excluded.add(rank)
            self._suspected.discard(rank)
        if news and self._on_dead is not None:
            self._on_dead(rank)
        return news

    def revive(self, rank: int) -> bool:
        """Take back a suspected ``rank`` (it answered): followed again where it is the lowest
        member not given up. An excluded member stays out. Returns whether it was taken back."""
        with self._lock:
            if rank not in self._suspected:
                return False
            self._suspected.discard(rank)
            self._leader = min(self._leader, rank)
        if self._on_alive is not None:
            self._on_alive(rank)
        return True

    def recheck(self, rank: int) -> bool:
        """Ping ``rank`` if it is suspected (a live peer says it leads, or a call to it failed), and
        take it back if it answers. Returns whether it was taken back."""
        with self._lock:
            if rank not in self._suspected:
                return False
        return self._ping(rank) and self.revive(rank)

    def add(self, rank: int) -> None:
        """A member that joined the group while it runs (it leads only once every lower rank is gone)."""
        with self._lock:
            if rank not in self.members:
                self.members = sorted([*self.members, rank])

    def resolve(self) -> int:
        """Find the leader again: the lowest-ranked member not given up that answers a ping
        (members found silent are suspected); this member if none below it answers."""
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
        """Until ``stop`` is set (then ``poke``), run a ``check`` every ``interval`` seconds (from
        the start of one to the next), or at once when poked. A member that watches is known by the
        leader to live, and learns of a dead leader, or of a live one it gave up, between its own
        calls."""
        due = clock.monotonic() + interval
        while not stop.is_set():
            clock.wait(self._wake, max(0.0, due - clock.monotonic()))
            self._wake.clear()
            due = clock.monotonic() + interval
            if not stop.is_set():
                self.check()

    def check(self) -> None:
        """One period of ``watch``: ping the leader (a silent one is suspected and its successor
        found); if it answers, or this member leads, ping one suspected member below the leader
        (the next after the one asked last, in turn) and take it back if it answers."""
        leader = self.leader
        if leader != self.me and (self.is_dead(leader) or not self._ping(leader)):
            self.mark_dead(leader)
            self.resolve()
            return
        with self._lock:
            below = sorted(rank for rank in self._suspected if rank < self._leader)
            if not below:
                return
            rank = next((r for r in below if r > self._asked), below[0])
            self._asked = rank
        self.recheck(rank)

    def poke(self) -> None:
        """Make ``watch`` check now (someone suspects the leader is gone, or it should stop)."""
        self._wake.set()

    def _set(self, rank: int) -> int:
        """Take ``rank`` (found answering) to lead, unless a lower member not given up was taken back
        meanwhile (``revive`` from another thread): that one leads."""
        with self._lock:
            self._leader = next(m for m in self.members
                                if m == rank or (m < rank and m not in self._suspected and m not in self._excluded))
            return self._leader
