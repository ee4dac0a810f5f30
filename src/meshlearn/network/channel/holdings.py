"""What the relay holds for the connections strangers open, and whom it drops when a cap is full.

Everything it holds counts against a descriptor budget, a share of the process's open-file limit.
A full cap makes room instead of turning the newcomer away: it evicts the connection that has
been idle longest (one that sent nothing, or a splice no byte went through lately), so a flood of
silent or stalled connections cannot lock out the busy, legitimate ones. All of it runs in the
relay's loop thread.
"""

from __future__ import annotations

import resource
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlearn.network.channel.splicer import READ, Loop, Splice, close_socket
from meshlearn.sparselog import SparseLog

if TYPE_CHECKING:
    from meshlearn.network.channel.allocations import Allocations, RelayAllocation

MAX_DESCRIPTORS = 16384  # descriptors the relay holds at once (listeners, connections, pipes), and at most
DESCRIPTOR_SHARE = 0.5  # this share of the process's open-file limit (the rest is the bootstrap's RPC's)
MAX_PIPES = 64  # kernel pipes lent to splices at once, and at most 1/16 of the descriptor budget
MIN_DESCRIPTORS = 16  # a tiny open-file limit still leaves the relay this many
MIN_PIPES = 2


def descriptor_budget() -> int:
    """Descriptors the relay may hold at once: DESCRIPTOR_SHARE of this process's open-file limit
    (its soft limit now), at most MAX_DESCRIPTORS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DESCRIPTORS
    return max(MIN_DESCRIPTORS, min(MAX_DESCRIPTORS, int(soft * DESCRIPTOR_SHARE)))


class Crowd:
    """Connections oldest first, grouped by source address (what a cap per address evicts from)."""

    def __init__(self):
        self.all: dict[Conn, bool] = {}
        self._by_address: dict[str, dict[Conn, bool]] = {}

    def __len__(self) -> int:
        return len(self.all)

    def add(self, conn: Conn) -> None:
        self.all[conn] = True
        self._by_address.setdefault(conn.source, {})[conn] = True

    def discard(self, conn: Conn) -> None:
        if self.all.pop(conn, False):
            group = self._by_address[conn.source]
            del group[conn]
            if not group:
                del self._by_address[conn.source]

    def of(self, source: str) -> list[Conn]:
        return list(self._by_address.get(source, ()))


@dataclass(eq=False)
class Conn:
    """A connection a stranger may have opened: a greeting on the agent port (no ``allocation``),
    or a client of an allocation, in one of its ``stage`` groups (pending, waiting, spliced).
    ``reader``: what the loop calls when it becomes readable, while it has sent nothing whole."""

    sock: socket.socket
    source: str
    since: float  # arrival; a client's first bytes, once they came
    allocation: RelayAllocation | None = None
    data: bytes = b""  # a greeting's line so far; a client's first bytes
    stage: dict | None = None
    splice: Splice | None = None
    reader: Callable[[int], None] | None = None

    def idle_since(self) -> float:
        return self.splice.last_active if self.splice is not None else self.since


@dataclass
class RelayCounts:
    """What the relay did: ``accepted`` (connections, every port), ``spliced`` (clients joined to
    an agent), ``refused`` (turned away: late, a bad line, no allocation, a full cap with nothing
    to evict), ``evicted`` (dropped to make room for a newcomer), ``paused`` (times a port
    stopped accepting for a while: out of descriptors)."""

    accepted: int = 0
    spliced: int = 0
    refused: int = 0
    evicted: int = 0
    paused: int = 0


class Holdings:
    """The connections the relay holds, counted against its descriptor budget: greetings on the
    agent port and clients that sent nothing (oldest first), spliced ones, and the evictions
    that make room for a newcomer. Runs in the loop's thread."""

    def __init__(self, loop: Loop, allocations: Allocations, warn: SparseLog):
        self.loop = loop
        self.allocations = allocations
        self.warn = warn
        self.counts = RelayCounts()
        self.greetings = Crowd()  # agent-port connections not past their first line
        self.unproven: dict[Conn, bool] = {}  # greetings and clients that sent nothing, oldest first
        self.sockets = 0  # connections held (listeners apart)
        self.splices = 0
        self.budget = self.pipes = 0  # set by size()

    def size(self, budget: int) -> None:
        """Hold everything within ``budget`` descriptors, some of them lent to splices as pipes."""
        self.budget = budget
        self.pipes = max(MIN_PIPES, min(MAX_PIPES, budget // 16))

    def close_socket(self, sock: socket.socket) -> None:
        """Close one connection the relay holds."""
        self.loop.unwatch(sock)
        close_socket(sock)
        self.sockets -= 1

    def refuse(self, sock: socket.socket) -> None:
        """Turn a connection away."""
        self.counts.refused += 1
        self.close_socket(sock)

    def drop(self, conn: Conn) -> None:
        """Close a greeting or a client, in whatever stage (a spliced one through its splice)."""
        if conn.splice is not None:
            conn.splice.close()  # the splice's end does the bookkeeping
            return
        self.unproven.pop(conn, None)
        if conn.allocation is None:
            self.greetings.discard(conn)
        else:
            conn.stage.pop(conn, None)
            conn.stage = None
            conn.allocation.clients.discard(conn)
        self.close_socket(conn.sock)

    def drop_late(self, conn: Conn) -> None:
        """Drop a connection past its deadline."""
        self.counts.refused += 1
        self.drop(conn)

    def evict(self, conn: Conn | None, cap: str) -> None:
        """Drop ``conn`` (if any) to make room under ``cap``."""
        if conn is None:
            return
        self.counts.evicted += 1
        self.warn.warning(cap, "relay: %s reached: dropped the connection idle longest to make room", cap)
        self.drop(conn)

    def enter(self, client: Conn, stage: dict) -> None:
        """Move a client of an allocation into ``stage`` (one of its pending, waiting, spliced)."""
        if client.stage is not None:
            del client.stage[client]
        else:
            client.allocation.clients.add(client)
        stage[client] = True
        client.stage = stage

    def make_room(self) -> bool:
        """Hold the newest connection within the descriptor budget: evict the oldest connection that
        sent nothing anywhere, else the splice idle longest; False if nothing can go."""
        listeners = 1 + len(self.allocations)
        while self.sockets + listeners + 2 * self.pipes > self.budget:
            victim = self.oldest_silent(self.unproven) or idlest_splice(self.all_spliced())
            if victim is None:
                return False
            self.evict(victim, "the descriptor budget")
        return True

    def all_spliced(self) -> list[Conn]:
        """The spliced clients of every allocation."""
        return [conn for allocation in self.allocations.live() for conn in allocation.spliced]

    def oldest_silent(self, conns: Iterable[Conn]) -> Conn | None:
        """The oldest of ``conns`` (greetings or pending clients, oldest first) that has still sent
        nothing whole: those whose bytes are waiting are served first, so that a flood of newcomers
        evicts only the silent."""
        for conn in list(conns):
            if self._silent(conn):
                conn.reader(READ)
                if self._silent(conn):
                    return conn
        return None

    def idlest_client(self, conns: list[Conn]) -> Conn | None:
        """Whom a full cap on clients evicts: the oldest silent one, else the splice idle longest,
        else (no other) the one waiting longest for a parked connection."""
        silent = self.oldest_silent(conn for conn in conns if conn.stage is conn.allocation.pending)
        if silent is not None:
            return silent
        held = [conn for conn in conns if conn.stage is not None]  # reading the others may have dropped some
        return idlest_splice(conn for conn in held if conn.splice is not None) or next(iter(held), None)

    def close_allocation(self, allocation: RelayAllocation) -> None:
        """Close an allocation taken out of the table: its port, parked connections and clients."""
        if allocation.closed:
            return
        allocation.closed = True
        allocation.acceptor.close()
        for sock in list(allocation.parked):
            self.close_socket(sock)
        allocation.parked.clear()
        for client in list(allocation.clients.all):
            self.drop(client)

    def _silent(self, conn: Conn) -> bool:
        """Whether ``conn`` is a greeting not past its line, or a client that sent no byte yet."""
        if conn.allocation is None:
            return conn in self.greetings.all
        return conn.stage is conn.allocation.pending


def idlest_splice(conns: Iterable[Conn]) -> Conn | None:
    """The spliced client whose splice has moved no byte for longest."""
    return min(conns, key=Conn.idle_since, default=None)


def expire(group: dict[Conn, bool], before: float, drop: Callable[[Conn], None]) -> None:
    """Drop the connections of ``group`` (oldest first) that came before ``before``."""
    while group:
        oldest = next(iter(group))
        if oldest.since > before:
            return
        drop(oldest)
