"""The relay's table of allocations: which key holds each one, for what work, and the caps on them.

The bootstrap gives an allocation only for registered work (a provider registering, a task
claimed); keys cost a holder of the network secret nothing, so the caps per source address bound
an insider, and a full cap makes room only by evicting the oldest allocation of a provider that
never finished registering, never one serving registered work. The bootstrap's handlers open and
close allocations from their threads while the relay's loop looks them up, so the table is
changed under one lock.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from meshlearn.errors import NetworkError, PortInUseError
from meshlearn.network.channel.holdings import Conn, Crowd
from meshlearn.network.channel.relaywire import listen
from meshlearn.network.channel.splicer import Acceptor

MAX_PER_OWNER = 8  # live allocations per participant key
MAX_ALLOCATIONS = 512  # live allocations in all, and at most a quarter of the descriptor budget (--relay-ports too)
ADDRESS_SHARE = 16  # one source address (a site's providers share one) holds at most 1/16 of the pool
SETTLE_TIME = 30.0  # seconds an allocation for a provider still registering has to become its registration's


@dataclass(frozen=True)
class Holder:
    """The registered work an allocation serves: a provider's registration (``kind`` "provider",
    ``name`` its id) or a claimed task ("task", the task's id). The bootstrap gives allocations
    only for such work and closes a holder's allocations when the work ends."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass(eq=False)
class RelayAllocation:
    """An allocation: its public port's acceptor, the agent connections parked for it, and its
    clients in their stages. ``settled``: its holder's work is registered (a provider's
    registration completed, a claimed task); an unsettled one may be evicted for a newcomer."""

    token: str
    port: int
    owner: str = ""
    source: str = ""
    holder: Holder | None = None
    settled: bool = True
    opened: float = field(default_factory=time.monotonic)
    acceptor: Acceptor | None = None
    parked: dict[socket.socket, bool] = field(default_factory=dict)  # oldest first
    pending: dict[Conn, bool] = field(default_factory=dict)  # clients that sent nothing yet, oldest first
    waiting: dict[Conn, bool] = field(default_factory=dict)  # clients waiting for a parked connection
    spliced: dict[Conn, bool] = field(default_factory=dict)
    clients: Crowd = field(default_factory=Crowd)  # all three, by address
    last_used: float = field(default_factory=time.monotonic)  # last time it had a parked or spliced connection
    closed: bool = False


class Allocations:
    """The live allocations by token, safe to use from any thread. Those it hands back as taken
    out of the table (replaced, evicted, released, unserved) are the caller's to close."""

    def __init__(self, host: str, public_host: str, ports: range | None = None):
        self.host = host  # where allocation ports listen
        self.public_host = public_host
        self.ports = ports  # allocation ports (None: any free port)
        self._by_token: dict[str, RelayAllocation] = {}
        self._lock = threading.Lock()  # guards _by_token and _stopped (the only state other threads touch)
        self._stopped = False
        self._bound = False  # the relay's agent port is bound: it may give allocations
        self._budget = 0

    def bind(self, budget: int) -> None:
        """The relay listens now, within ``budget`` descriptors: allocations may be given."""
        self._budget = budget
        self._bound = True

    def stop(self) -> None:
        """Give no allocation any more: the relay stops."""
        with self._lock:
            self._stopped = True

    def __len__(self) -> int:
        return len(self._by_token)

    def address_of(self, allocation: RelayAllocation) -> str:
        """The public HOST:PORT clients connect to."""
        return f"{self.public_host}:{allocation.port}"

    def pool_size(self) -> int:
        """Live allocations the relay holds at most: MAX_ALLOCATIONS, within a quarter of the descriptor budget."""
        return min(MAX_ALLOCATIONS, self._budget // 4)

    def per_address(self) -> int:
        """Live allocations one source address holds at most: its share of the pool."""
        return max(2, self.pool_size() // ADDRESS_SHARE)

    def open(self, owner: str, source: str, holder: Holder | None, settled: bool,
             serve: Callable[[RelayAllocation, socket.socket], Acceptor],
             ) -> tuple[RelayAllocation, list[RelayAllocation], list[RelayAllocation]]:
        """A new allocation on a port of its own, its acceptor made by ``serve``: (it, the holder's
        earlier ones it replaces, those evicted for it), all taken out of the table. A provider
        has one: its earlier one is replaced. Beyond MAX_PER_OWNER live ones per owner, the
        address's share of the pool or the pool itself, the oldest unsettled allocation in the
        way is evicted; refused (NetworkError) when none is."""
        with self._lock:
            replaced = self._take_earlier(owner, holder)
            evicted = self._room_for(owner, source)
            listener = self._listener()
            allocation = RelayAllocation(secrets.token_hex(16), listener.getsockname()[1], owner, source, holder,
                                         settled)
            allocation.acceptor = serve(allocation, listener)
            self._by_token[allocation.token] = allocation
        return allocation, replaced, evicted

    def get(self, token: str) -> RelayAllocation | None:
        """The live allocation whose agents present ``token`` (None: no such)."""
        with self._lock:
            return self._by_token.get(token)

    def live(self) -> list[RelayAllocation]:
        """Every live allocation."""
        with self._lock:
            return list(self._by_token.values())

    def settle(self, address: str, owner: str, holder: Holder) -> bool:
        """Mark the allocation at public ``address`` as serving registered work, if ``owner``
        holds it for ``holder``; whether it did."""
        with self._lock:
            allocation = self._at(address)
            if allocation is None or allocation.owner != owner or allocation.holder != holder:
                return False
            allocation.settled = True
            return True

    def holders(self, settled: bool = False) -> set[Holder]:
        """The holders of live allocations (only those whose work is registered, if ``settled``)."""
        with self._lock:
            return {a.holder for a in self._by_token.values()
                    if a.holder is not None and (a.settled or not settled)}

    def owner_of(self, address: str) -> str | None:
        """The owner of the live allocation whose public address is ``address`` (None: no such)."""
        with self._lock:
            allocation = self._at(address)
            return None if allocation is None else allocation.owner

    def holder_of(self, address: str) -> Holder | None:
        """The holder of the live allocation whose public address is ``address`` (None: no such)."""
        with self._lock:
            allocation = self._at(address)
            return None if allocation is None else allocation.holder

    def take(self, token: str, owner: str) -> RelayAllocation | None:
        """The allocation ``token`` out of the table, if ``owner`` holds it (None: it does not)."""
        with self._lock:
            allocation = self._by_token.get(token)
            if allocation is None or allocation.owner != owner:
                return None
            del self._by_token[token]
            return allocation

    def take_holder(self, holder: Holder) -> list[RelayAllocation]:
        """Every allocation serving ``holder``, out of the table."""
        with self._lock:
            gone = [a for a in self._by_token.values() if a.holder == holder]
            for allocation in gone:
                del self._by_token[allocation.token]
        return gone

    def take_all(self) -> list[RelayAllocation]:
        """Every allocation, out of the table."""
        with self._lock:
            allocations = list(self._by_token.values())
            self._by_token.clear()
        return allocations

    def take_unserved(self, idle_close: float) -> list[RelayAllocation]:
        """Out of the table: allocations nobody has served for ``idle_close`` seconds, and those
        of providers that did not register within SETTLE_TIME."""
        now = time.monotonic()
        idle = []
        for allocation in self.live():
            if allocation.parked or allocation.spliced:
                allocation.last_used = now
            unregistered = not allocation.settled and now - allocation.opened > SETTLE_TIME
            unserved = now - allocation.last_used > idle_close and not (allocation.parked or allocation.spliced)
            if unregistered or unserved:
                idle.append(allocation)
        with self._lock:
            for allocation in idle:
                self._by_token.pop(allocation.token, None)
        return idle

    # --- under the lock ---

    def _at(self, address: str) -> RelayAllocation | None:
        for allocation in self._by_token.values():
            if self.address_of(allocation) == address:
                return allocation
        return None

    def _take_earlier(self, owner: str, holder: Holder | None) -> list[RelayAllocation]:
        """A provider's earlier allocations (one per registered provider), out of the table."""
        if holder is None or holder.kind != "provider":
            return []
        earlier = [a for a in self._by_token.values() if a.holder == holder and a.owner == owner]
        for allocation in earlier:
            del self._by_token[allocation.token]
        return earlier

    def _room_for(self, owner: str, source: str) -> list[RelayAllocation]:
        """Make room for one more allocation of ``owner`` from ``source`` under every cap, evicting
        the oldest unsettled allocation in the way (taken out of the table, returned to be
        closed); NetworkError where a cap is full of settled ones."""
        if self._stopped or not self._bound:
            raise NetworkError("the relay is not running")
        caps = [(lambda a: True, self.pool_size(), (f"the relay holds {self.pool_size()} allocations, its most, "
                                                    "all serving registered providers and tasks: try again later"))]
        if source:
            caps.append((lambda a: a.source == source, self.per_address(), (f"{source} holds {self.per_address()} "
                         "relay allocations already, its share: close one first")))
        if owner:
            caps.append((lambda a: a.owner == owner, MAX_PER_OWNER, (f"this key holds {MAX_PER_OWNER} relay "
                         "allocations already: close one first")))
        evicted = []
        for counts, most, full in caps:
            group = [a for a in self._by_token.values() if counts(a)]
            if len(group) < most:
                continue
            unsettled = [a for a in group if not a.settled]
            if not unsettled:
                raise NetworkError(full)
            oldest = min(unsettled, key=lambda a: a.opened)
            del self._by_token[oldest.token]
            evicted.append(oldest)
        return evicted

    def _listener(self) -> socket.socket:
        for port in (self.ports or [0]):
            try:
                return listen(self.host, port)
            except PortInUseError:
                continue
            except OSError as exc:  # out of descriptors, most likely
                raise NetworkError(f"the relay cannot open a port now ({exc}): try again later") from None
        raise NetworkError("the relay has no free port left: widen --relay-ports")
