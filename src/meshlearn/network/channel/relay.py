"""Reaching a participant behind NAT: a relay both sides dial out to, splicing TCP byte streams.

The pattern of TURN allocations and Tailscale's DERP: a participant that cannot accept
connections asks the relay for an *allocation*, a public port of the relay, and keeps a few
*agent* connections parked at the relay's agent port (dialed out, so NAT lets them through). A
client connects to the allocation's port as if it were the participant; once it has sent its
first bytes (a ZeroMQ peer sends its greeting at once), the relay hands it a parked agent
connection, writes ``G`` and those bytes to it, and from then on copies bytes both ways. The
agent (relayagent.py) connects to the participant's own server on that machine and copies bytes
too.

The relay sees only what flows inside: CurveZMQ sessions and sealed engine messages, encrypted
end to end between the client and the participant (the relay holds no key), so it learns sizes
and timing only. The agent port also answers ``KEY``: the bootstrap's public key, for trust on
first use.

Strangers can reach the relay, so it runs as one thread (``splicer.Loop``: no thread per
connection) and everything they can make it hold is capped (docs/security.md). This module is
the service: its lifecycle, its calls from the bootstrap's threads, and its timers. Its parts:
the table of allocations (allocations.py), what it holds and whom a full cap evicts
(holdings.py), the agent port (agentport.py) and the allocations' public ports (publicports.py).
Running out of descriptors pauses accepting, never the relay. Parked connections carry TCP
keepalives, and the relay drops those whose agent is gone, so an allocation nobody serves any
more is closed after IDLE_CLOSE.
"""

from __future__ import annotations

import logging
import socket
import time
from functools import partial

from meshlearn.network.channel.agentport import AgentPort
from meshlearn.network.channel.allocations import Allocations, Holder, RelayAllocation
from meshlearn.network.channel.holdings import Holdings, descriptor_budget, expire
from meshlearn.network.channel.publicports import (
    CLIENT_WAIT,
    FIRST_BYTES_TIME,
    PublicPorts,
)
from meshlearn.network.channel.relaywire import GREETING_TIME, listen
from meshlearn.network.channel.splicer import Acceptor, Loop, Splicer, close_socket
from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)

IDLE_CLOSE = 120.0  # an allocation with neither a parked nor a spliced connection for this long is closed
SWEEP_EVERY = 5.0  # seconds between looks for allocations to close (IDLE_CLOSE, allocations.SETTLE_TIME)
TICK = 0.25  # seconds between checks of the connections' deadlines (GREETING_TIME, FIRST_BYTES_TIME, CLIENT_WAIT)


class Relay:
    """The relay: an agent port (plus ``KEY``) and one public port per allocation, all served by
    one thread. ``allocate``, ``release`` and the other calls on allocations may be made from any
    thread. Counters: ``accepted``, ``spliced``, ``refused``, ``evicted``, ``paused``
    (holdings.RelayCounts says what each counts)."""

    def __init__(self, host: str, port: int, public_host: str, key_line: str = "",
                 ports: range | None = None, client_wait: float = CLIENT_WAIT, idle_close: float = IDLE_CLOSE,
                 sweep_every: float = SWEEP_EVERY):
        self.host, self.port = host, port
        self.public_host = public_host
        self.client_wait = client_wait
        self.idle_close = idle_close
        self.sweep_every = sweep_every
        self._allocations = Allocations(host, public_host, ports)
        self._listener: socket.socket | None = None
        self._acceptor: Acceptor | None = None
        self._loop = Loop("relay", on_stop=self._close_everything)
        self._splicer: Splicer | None = None
        self._warn = SparseLog(log)
        self._holdings = Holdings(self._loop, self._allocations, self._warn)
        self._public = PublicPorts(self._holdings)
        self._agent_port = AgentPort(self._holdings, self._allocations, key_line, self._public.pair)

    def bind(self) -> int:
        """Listen on the agent port (PortInUseError if taken) and size the descriptor budget; the port."""
        self._listener = listen(self.host, self.port)
        self.port = self._listener.getsockname()[1]
        budget = descriptor_budget()
        self._holdings.size(budget)
        self._allocations.bind(budget)
        return self.port

    @property
    def address(self) -> str:
        return f"{self.public_host}:{self.port}"

    def start(self) -> None:
        """Serve, in the relay's thread (binding first if bind() was not called)."""
        if self._listener is None:
            self.bind()
        self._splicer = self._public.splicer = Splicer(self._loop, self._holdings.pipes)
        self._acceptor = Acceptor(self._loop, self._listener, self._agent_port.connected, "relay agent port",
                                  self._count_pause)
        self._loop.start()
        self._loop.call_soon(self._begin)

    def stop(self) -> None:
        """Stop serving and close every port and connection (back when this returns)."""
        self._allocations.stop()
        self._loop.stop()

    # --- allocations (any thread) ---

    def allocate(self, owner: str = "", source: str = "", holder: Holder | None = None,
                 settled: bool = True) -> tuple[str, str]:
        """A new allocation for ``owner`` (a participant's key) asking from ``source`` (its IP
        address), serving ``holder``: (token its agents present, public HOST:PORT clients connect
        to). A provider has one: its earlier one is closed. Beyond MAX_PER_OWNER live ones per
        owner, the address's share of the pool (``per_address``) or the pool itself
        (``pool_size``), the oldest unsettled allocation in the way is evicted; refused
        (NetworkError) when none is: what serves registered work is never evicted for a newcomer."""
        allocation, replaced, evicted = self._allocations.open(owner, source, holder, settled, self._serve)
        for gone in replaced + evicted:
            self._close_later(gone)
        for gone in evicted:
            self._warn.warning("allocation evicted", "relay: the pool, an address's or a key's share was full: "
                               "closed the oldest allocation of a provider that never registered (%s)", gone.holder)
        self._loop.call_soon(partial(self._open_allocation, allocation))
        return allocation.token, self._allocations.address_of(allocation)

    def settle(self, address: str, owner: str, holder: Holder) -> bool:
        """Mark the allocation at public ``address`` as serving registered work, if ``owner``
        holds it for ``holder`` (a provider's registration completed); whether it did."""
        return self._allocations.settle(address, owner, holder)

    def holders(self, settled: bool = False) -> set[Holder]:
        """The holders of live allocations (only those whose work is registered, if ``settled``):
        the bootstrap checks that work is still going on."""
        return self._allocations.holders(settled)

    def release_holder(self, holder: Holder) -> int:
        """Close every allocation serving ``holder`` (its provider left, its task ended); how many."""
        gone = self._allocations.take_holder(holder)
        for allocation in gone:
            self._close_later(allocation)
        return len(gone)

    def pool_size(self) -> int:
        """Live allocations the relay holds at most: MAX_ALLOCATIONS, within a quarter of the descriptor budget."""
        return self._allocations.pool_size()

    def per_address(self) -> int:
        """Live allocations one source address holds at most: its share of the pool."""
        return self._allocations.per_address()

    def release(self, token: str, owner: str = "") -> bool:
        """Close the allocation ``token`` if ``owner`` holds it; whether it did."""
        allocation = self._allocations.take(token, owner)
        if allocation is None:
            return False
        self._close_later(allocation)
        return True

    def owner_of(self, address: str) -> str | None:
        """The owner of the live allocation whose public address is ``address`` (None: no such)."""
        return self._allocations.owner_of(address)

    def holder_of(self, address: str) -> Holder | None:
        """The holder of the live allocation whose public address is ``address`` (None: no such)."""
        return self._allocations.holder_of(address)

    # --- counters ---

    @property
    def accepted(self) -> int:
        return self._holdings.counts.accepted

    @property
    def spliced(self) -> int:
        return self._holdings.counts.spliced

    @property
    def refused(self) -> int:
        return self._holdings.counts.refused

    @property
    def evicted(self) -> int:
        return self._holdings.counts.evicted

    @property
    def paused(self) -> int:
        return self._holdings.counts.paused

    def _serve(self, allocation: RelayAllocation, listener: socket.socket) -> Acceptor:
        """The acceptor of a new allocation's public port (made under the table's lock)."""
        return Acceptor(self._loop, listener, partial(self._public.connected, allocation),
                        f"relay port {allocation.port}", self._count_pause)

    def _close_later(self, allocation: RelayAllocation) -> None:
        """Close an allocation already taken out of the table, in the loop's thread."""
        if not self._loop.call_soon(partial(self._holdings.close_allocation, allocation)):
            self._holdings.close_allocation(allocation)  # the loop is over: nothing else touches it now

    # --- everything below runs in the loop's thread ---

    def _begin(self) -> None:
        self._acceptor.start()
        self._loop.every(TICK, self._expire)
        self._loop.every(self.sweep_every, self._sweep)

    def _count_pause(self) -> None:
        self._holdings.counts.paused += 1

    def _open_allocation(self, allocation: RelayAllocation) -> None:
        if not allocation.closed:
            allocation.acceptor.start()

    def _close_everything(self) -> None:
        for allocation in self._allocations.take_all():
            self._holdings.close_allocation(allocation)
        for greeting in list(self._holdings.greetings.all):
            self._holdings.drop(greeting)
        if self._acceptor is not None:
            self._acceptor.close()
        elif self._listener is not None:
            close_socket(self._listener)
        if self._splicer is not None:
            self._splicer.close()

    def _expire(self) -> None:
        """Drop greetings, silent clients and waiting clients past their deadlines."""
        now = time.monotonic()
        drop_late = self._holdings.drop_late
        expire(self._holdings.greetings.all, now - GREETING_TIME, drop_late)
        for allocation in self._allocations.live():
            expire(allocation.pending, now - FIRST_BYTES_TIME, drop_late)
            expire(allocation.waiting, now - self.client_wait, drop_late)

    def _sweep(self) -> None:
        """Close allocations nobody has served for idle_close, and those of providers that did not
        register within SETTLE_TIME."""
        for allocation in self._allocations.take_unserved(self.idle_close):
            why = "its provider did not register" if not allocation.settled else "nobody serves it any more"
            log.info("relay: allocation on port %d closed (%s)", allocation.port, why)
            self._holdings.close_allocation(allocation)
