"""Reaching a participant behind NAT: a relay both sides dial out to, splicing TCP byte streams.

The pattern of TURN allocations and Tailscale's DERP: a participant that cannot accept
connections asks the relay for an *allocation*, a public port of the relay, and keeps a few
*agent* connections parked at the relay's agent port (dialed out, so NAT lets them through). A
client connects to the allocation's port as if it were the participant; once it has sent its
first bytes (a ZeroMQ peer sends its greeting at once), the relay hands it a parked agent
connection, writes ``G`` and those bytes to it, and from then on copies bytes both ways. The
agent connects to the participant's own server on this machine and copies bytes too.

The relay sees only what flows inside: CurveZMQ sessions and sealed engine messages, encrypted
end to end between the client and the participant (the relay holds no key), so it learns sizes
and timing only. The agent port also answers ``KEY``: the bootstrap's public key, for trust on
first use.

Strangers can reach the relay, so it runs as one thread (``splicer.Loop``: no thread per
connection) and everything they can make it hold is capped (the constants below,
docs/security.md). A full cap makes room instead of turning the newcomer away: it evicts the
connection that has been idle longest (one that sent nothing, or a splice no byte went through
lately), so a flood of silent or stalled connections cannot lock out the busy, legitimate ones.
Running out of descriptors pauses accepting, never the relay. Parked connections carry TCP
keepalives, and the relay drops those whose agent is gone, so an allocation nobody serves any
more is closed after IDLE_CLOSE.
"""

from __future__ import annotations

import logging
import resource
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

from meshlearn.errors import NetworkError, PortInUseError, Unreachable
from meshlearn.network.channel.addresses import is_wildcard
from meshlearn.network.channel.envelope import field_of
from meshlearn.network.channel.splicer import (
    READ,
    Acceptor,
    Loop,
    Splice,
    Splicer,
    close_socket,
    dial,
)
from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)

PARKED = 4  # agent connections an allocation keeps waiting at the relay
# Caps on what anyone who can connect, or any holder of the network secret, makes the relay hold.
# Allocations (the bootstrap gives one only for registered work: a provider registering, a task
# claimed; keys cost a holder of the secret nothing, so the caps per address bound an insider):
MAX_PER_OWNER = 8  # live allocations per participant key
MAX_ALLOCATIONS = 512  # live allocations in all, and at most a quarter of the descriptor budget (--relay-ports too)
ADDRESS_SHARE = 16  # one source address (a site's providers share one) holds at most 1/16 of the pool
SETTLE_TIME = 30.0  # seconds an allocation for a provider still registering has to become its registration's
# The agent port: participants' agents (AGENT token) and anyone asking for the key (KEY):
MAX_PARKED = 16  # parked agent connections per allocation (more are refused)
MAX_GREETING = 256  # connections not past their first line: a newcomer evicts the oldest...
MAX_GREETING_PER_ADDRESS = 32  # ... or, over this many from its address, that address's oldest
GREETING_TIME = 3.0  # seconds a connection to the agent port has to send its whole first line
# An allocation's public port (the participant's clients, and strangers):
FIRST_BYTES = 4096  # at most this much of a client's first bytes is held until it is spliced
FIRST_BYTES_TIME = 3.0  # seconds a client has to send its first bytes (ZeroMQ sends its greeting at once)
MAX_PENDING = 32  # clients per allocation that sent nothing yet: a newcomer evicts the oldest
MAX_WAITING = 32  # clients per allocation waiting for a parked connection: a newcomer evicts the oldest
CLIENT_WAIT = 10.0  # seconds a client waits for a parked agent connection
MAX_SPLICES = 48  # live splices per allocation: a new one evicts the one idle longest
MAX_SPLICES_TOTAL = 512  # live splices of the whole relay: likewise
MAX_CLIENTS_PER_ADDRESS = 16  # one address's connections to an allocation: its newcomer evicts its idlest
# The whole relay:
MAX_DESCRIPTORS = 16384  # descriptors the relay holds at once (listeners, connections, pipes), and at most
DESCRIPTOR_SHARE = 0.5  # this share of the process's open-file limit (the rest is the bootstrap's RPC's)
MAX_PIPES = 64  # kernel pipes lent to splices at once, and at most 1/16 of the descriptor budget
IDLE_CLOSE = 120.0  # an allocation with neither a parked nor a spliced connection for this long is closed
SWEEP_EVERY = 5.0
TICK = 0.25  # seconds between checks of the deadlines above
# The agent (the participant's side):
AGENT_MAX = MAX_SPLICES + MAX_PARKED  # relay connections an agent holds at once, parked or spliced
AGENT_PIPES = 16
REFUSALS_LOST = 5  # parked connections closed in a row before any client came: the relay forgot the token
LINE_MAX = 128
LISTEN_BACKLOG = 512
GO = b"G"
KEY_REQUEST = b"KEY"
KEY_REPLY = b"meshlearn-bootstrap-key "


def _tune(sock: socket.socket) -> None:
    """No Nagle delay, and TCP keepalives, so a connection whose other end vanished (a home router
    that forgot it) is noticed within a minute or so instead of never."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def read_line(sock: socket.socket, timeout: float = GREETING_TIME) -> bytes:
    """One short line (no newline), read byte by byte so nothing after it is consumed; the whole
    line must arrive within ``timeout`` seconds (TimeoutError otherwise)."""
    deadline = time.monotonic() + timeout
    line = bytearray()
    while len(line) <= LINE_MAX:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete line in time")
        sock.settimeout(left)
        byte = sock.recv(1)
        if not byte or byte == b"\n":
            break
        line += byte
    sock.settimeout(None)
    return bytes(line)


def descriptor_budget() -> int:
    """Descriptors the relay may hold at once: DESCRIPTOR_SHARE of this process's open-file limit
    (its soft limit now), at most MAX_DESCRIPTORS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DESCRIPTORS
    return max(16, min(MAX_DESCRIPTORS, int(soft * DESCRIPTOR_SHARE)))  # 16: a tiny limit still leaves it some


def _alive(sock: socket.socket) -> bool:
    """Whether a parked connection is still usable (a parked agent never sends anything: EOF,
    an error or a byte all mean it is not)."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False


class _Crowd:
    """Connections oldest first, grouped by source address (what a cap per address evicts from)."""

    def __init__(self):
        self.all: dict[_Conn, bool] = {}
        self._by_address: dict[str, dict[_Conn, bool]] = {}

    def __len__(self) -> int:
        return len(self.all)

    def add(self, conn: _Conn) -> None:
        self.all[conn] = True
        self._by_address.setdefault(conn.source, {})[conn] = True

    def discard(self, conn: _Conn) -> None:
        if self.all.pop(conn, False):
            group = self._by_address[conn.source]
            del group[conn]
            if not group:
                del self._by_address[conn.source]

    def of(self, source: str) -> list[_Conn]:
        return list(self._by_address.get(source, ()))


@dataclass(eq=False)
class _Conn:
    """A connection a stranger may have opened: a greeting on the agent port (no ``allocation``),
    or a client of an allocation, in one of its ``stage`` groups (pending, waiting, spliced)."""

    sock: socket.socket
    source: str
    since: float  # arrival; a client's first bytes, once they came
    allocation: _Allocation | None = None
    data: bytes = b""  # a greeting's line so far; a client's first bytes
    stage: dict | None = None
    splice: Splice | None = None

    def idle_since(self) -> float:
        return self.splice.last_active if self.splice is not None else self.since


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
class _Allocation:
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
    pending: dict[_Conn, bool] = field(default_factory=dict)  # clients that sent nothing yet, oldest first
    waiting: dict[_Conn, bool] = field(default_factory=dict)  # clients waiting for a parked connection
    spliced: dict[_Conn, bool] = field(default_factory=dict)
    clients: _Crowd = field(default_factory=_Crowd)  # all three, by address
    last_used: float = field(default_factory=time.monotonic)  # last time it had a parked or spliced connection
    closed: bool = False


class Relay:
    """The relay: an agent port (plus ``KEY``) and one public port per allocation, all served by
    one thread. ``allocate``, ``release`` and ``owner_of`` may be called from any thread.
    Counters: ``accepted`` (connections, every port), ``spliced`` (clients joined to an agent),
    ``refused`` (turned away: late, a bad line, no allocation, a full cap with nothing to evict),
    ``evicted`` (dropped to make room for a newcomer), ``paused`` (times a port stopped
    accepting for a while: out of descriptors)."""

    def __init__(self, host: str, port: int, public_host: str, key_line: str = "",
                 ports: range | None = None, client_wait: float = CLIENT_WAIT, idle_close: float = IDLE_CLOSE,
                 sweep_every: float = SWEEP_EVERY):
        self.host, self.port = host, port
        self.public_host = public_host
        self.key_line = key_line  # the bootstrap's public key, as printed
        self.ports = ports  # allocation ports (None: any free port)
        self.client_wait = client_wait
        self.idle_close = idle_close
        self.sweep_every = sweep_every
        self._allocations: dict[str, _Allocation] = {}
        self._lock = threading.Lock()  # guards _allocations and _stopped (the only state other threads touch)
        self._stopped = False
        self._listener: socket.socket | None = None
        self._acceptor: Acceptor | None = None
        self._loop = Loop("relay", on_stop=self._close_everything)
        self._splicer: Splicer | None = None
        self._budget = self._pipes = 0  # set by bind()
        self._greetings = _Crowd()  # agent-port connections not past their first line
        self._unproven: dict[_Conn, bool] = {}  # greetings and clients that sent nothing, oldest first
        self._sockets = 0  # connections held (listeners apart)
        self._splices = 0
        self._warn = SparseLog(log)
        self.accepted = self.spliced = self.refused = self.evicted = self.paused = 0

    def bind(self) -> int:
        """Listen on the agent port (PortInUseError if taken) and size the descriptor budget; the port."""
        self._listener = _listen(self.host, self.port)
        self.port = self._listener.getsockname()[1]
        self._budget = descriptor_budget()
        self._pipes = max(2, min(MAX_PIPES, self._budget // 16))
        return self.port

    @property
    def address(self) -> str:
        return f"{self.public_host}:{self.port}"

    def start(self) -> None:
        """Serve, in the relay's thread (binding first if bind() was not called)."""
        if self._listener is None:
            self.bind()
        self._splicer = Splicer(self._loop, self._pipes)
        self._acceptor = Acceptor(self._loop, self._listener, self._agent_connected, "relay agent port",
                                  self._count_pause)
        self._loop.start()
        self._loop.call_soon(self._begin)

    def stop(self) -> None:
        """Stop serving and close every port and connection (back when this returns)."""
        with self._lock:
            self._stopped = True
        self._loop.stop()

    def allocate(self, owner: str = "", source: str = "", holder: Holder | None = None,
                 settled: bool = True) -> tuple[str, str]:
        """A new allocation for ``owner`` (a participant's key) asking from ``source`` (its IP
        address), serving ``holder``: (token its agents present, public HOST:PORT clients connect
        to). A provider has one: its earlier one is closed. Beyond MAX_PER_OWNER live ones per
        owner, the address's share of the pool (``per_address``) or the pool itself
        (``pool_size``), the oldest unsettled allocation in the way is evicted; refused
        (NetworkError) when none is: what serves registered work is never evicted for a newcomer."""
        with self._lock:
            replaced = self._take_earlier(owner, holder)
            evicted = self._room_for_allocation(owner, source)
            listener = self._allocation_listener()
            allocation = _Allocation(secrets.token_hex(16), listener.getsockname()[1], owner, source, holder, settled)
            allocation.acceptor = Acceptor(self._loop, listener, partial(self._client_connected, allocation),
                                           f"relay port {allocation.port}", self._count_pause)
            self._allocations[allocation.token] = allocation
        for gone in replaced + evicted:
            self._close_later(gone)
        for gone in evicted:
            self._warn.warning("allocation evicted", "relay: the pool, an address's or a key's share was full: "
                               "closed the oldest allocation of a provider that never registered (%s)", gone.holder)
        self._loop.call_soon(partial(self._open_allocation, allocation))
        return allocation.token, f"{self.public_host}:{allocation.port}"

    def settle(self, address: str, owner: str, holder: Holder) -> bool:
        """Mark the allocation at public ``address`` as serving registered work, if ``owner``
        holds it for ``holder`` (a provider's registration completed); whether it did."""
        with self._lock:
            allocation = self._at(address)
            if allocation is None or allocation.owner != owner or allocation.holder != holder:
                return False
            allocation.settled = True
            return True

    def holders(self, settled: bool = False) -> set[Holder]:
        """The holders of live allocations (only those whose work is registered, if ``settled``):
        the bootstrap checks that work is still going on."""
        with self._lock:
            return {a.holder for a in self._allocations.values()
                    if a.holder is not None and (a.settled or not settled)}

    def release_holder(self, holder: Holder) -> int:
        """Close every allocation serving ``holder`` (its provider left, its task ended); how many."""
        with self._lock:
            gone = [a for a in self._allocations.values() if a.holder == holder]
            for allocation in gone:
                del self._allocations[allocation.token]
        for allocation in gone:
            self._close_later(allocation)
        return len(gone)

    def pool_size(self) -> int:
        """Live allocations the relay holds at most: MAX_ALLOCATIONS, within a quarter of the descriptor budget."""
        return min(MAX_ALLOCATIONS, self._budget // 4)

    def per_address(self) -> int:
        """Live allocations one source address holds at most: its share of the pool."""
        return max(2, self.pool_size() // ADDRESS_SHARE)

    def release(self, token: str, owner: str = "") -> bool:
        """Close the allocation ``token`` if ``owner`` holds it; whether it did."""
        with self._lock:
            allocation = self._allocations.get(token)
            if allocation is None or allocation.owner != owner:
                return False
            del self._allocations[token]
        self._close_later(allocation)
        return True

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

    # --- allocations (callers' threads, under the lock) ---

    def _at(self, address: str) -> _Allocation | None:
        for allocation in self._allocations.values():
            if f"{self.public_host}:{allocation.port}" == address:
                return allocation
        return None

    def _close_later(self, allocation: _Allocation) -> None:
        """Close an allocation already taken out of the table, in the loop's thread."""
        if not self._loop.call_soon(partial(self._close_allocation, allocation)):
            self._close_allocation(allocation)  # the loop is over: nothing else touches it now

    def _take_earlier(self, owner: str, holder: Holder | None) -> list[_Allocation]:
        """A provider's earlier allocations (one per registered provider), out of the table."""
        if holder is None or holder.kind != "provider":
            return []
        earlier = [a for a in self._allocations.values() if a.holder == holder and a.owner == owner]
        for allocation in earlier:
            del self._allocations[allocation.token]
        return earlier

    def _room_for_allocation(self, owner: str, source: str) -> list[_Allocation]:
        """Make room for one more allocation of ``owner`` from ``source`` under every cap, evicting
        the oldest unsettled allocation in the way (taken out of the table, returned to be
        closed); NetworkError where a cap is full of settled ones."""
        if self._stopped or self._listener is None:
            raise NetworkError("the relay is not running")
        caps = [(lambda a: True, self.pool_size(), f"the relay holds {self.pool_size()} allocations, its most, all "
                 "serving registered providers and tasks: try again later")]
        if source:
            caps.append((lambda a: a.source == source, self.per_address(), f"{source} holds {self.per_address()} "
                         "relay allocations already, its share: close one first"))
        if owner:
            caps.append((lambda a: a.owner == owner, MAX_PER_OWNER, f"this key holds {MAX_PER_OWNER} relay "
                         "allocations already: close one first"))
        evicted = []
        for counts, most, full in caps:
            group = [a for a in self._allocations.values() if counts(a)]
            if len(group) < most:
                continue
            unsettled = [a for a in group if not a.settled]
            if not unsettled:
                raise NetworkError(full)
            oldest = min(unsettled, key=lambda a: a.opened)
            del self._allocations[oldest.token]
            evicted.append(oldest)
        return evicted

    def _allocation_listener(self) -> socket.socket:
        for port in (self.ports or [0]):
            try:
                return _listen(self.host, port)
            except PortInUseError:
                continue
            except OSError as exc:  # out of descriptors, most likely
                raise NetworkError(f"the relay cannot open a port now ({exc}): try again later") from None
        raise NetworkError("the relay has no free port left: widen --relay-ports")

    # --- everything below runs in the loop's thread ---

    def _begin(self) -> None:
        self._acceptor.start()
        self._loop.every(TICK, self._expire)
        self._loop.every(self.sweep_every, self._sweep)

    def _count_pause(self) -> None:
        self.paused += 1

    def _open_allocation(self, allocation: _Allocation) -> None:
        if not allocation.closed:
            allocation.acceptor.start()

    def _close_allocation(self, allocation: _Allocation) -> None:
        if allocation.closed:
            return
        allocation.closed = True
        allocation.acceptor.close()
        for sock in list(allocation.parked):
            self._close_socket(sock)
        allocation.parked.clear()
        for client in list(allocation.clients.all):
            self._drop(client)

    def _close_everything(self) -> None:
        with self._lock:
            allocations = list(self._allocations.values())
            self._allocations.clear()
        for allocation in allocations:
            self._close_allocation(allocation)
        for greeting in list(self._greetings.all):
            self._drop(greeting)
        if self._acceptor is not None:
            self._acceptor.close()
        elif self._listener is not None:
            close_socket(self._listener)
        if self._splicer is not None:
            self._splicer.close()

    def _live_allocations(self) -> list[_Allocation]:
        with self._lock:
            return list(self._allocations.values())

    def _close_socket(self, sock: socket.socket) -> None:
        self._loop.unwatch(sock)
        close_socket(sock)
        self._sockets -= 1

    def _refuse(self, sock: socket.socket) -> None:
        self.refused += 1
        self._close_socket(sock)

    # --- room: caps, eviction, the descriptor budget ---

    def _evict(self, conn: _Conn | None, cap: str) -> None:
        if conn is None:
            return
        self.evicted += 1
        self._warn.warning(cap, "relay: %s reached: dropped the connection idle longest to make room", cap)
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        """Close a greeting or a client, in whatever stage (a spliced one through its splice)."""
        if conn.splice is not None:
            conn.splice.close()  # _unspliced does the bookkeeping
            return
        self._unproven.pop(conn, None)
        if conn.allocation is None:
            self._greetings.discard(conn)
        else:
            conn.stage.pop(conn, None)
            conn.stage = None
            conn.allocation.clients.discard(conn)
        self._close_socket(conn.sock)

    def _make_room(self) -> bool:
        """Hold the newest connection within the descriptor budget: evict the oldest connection that
        sent nothing anywhere, else the splice idle longest; False if nothing can go."""
        listeners = 1 + len(self._allocations)
        while self._sockets + listeners + 2 * self._pipes > self._budget:
            victim = self._oldest_silent(self._unproven) or _idlest_splice(self._all_spliced())
            if victim is None:
                return False
            self._evict(victim, "the descriptor budget")
        return True

    def _make_room_for_splice(self, allocation: _Allocation) -> None:
        if len(allocation.spliced) >= MAX_SPLICES:
            self._evict(_idlest_splice(allocation.spliced), "an allocation's splices cap")
        if self._splices >= MAX_SPLICES_TOTAL:
            self._evict(_idlest_splice(self._all_spliced()), "the relay's splices cap")

    def _all_spliced(self) -> list[_Conn]:
        return [conn for allocation in self._live_allocations() for conn in allocation.spliced]

    def _oldest_silent(self, conns: Iterable[_Conn]) -> _Conn | None:
        """The oldest of ``conns`` (greetings or pending clients, oldest first) that has still sent
        nothing whole: those whose bytes are waiting are served first, so that a flood of newcomers
        evicts only the silent."""
        for conn in list(conns):
            if conn.allocation is None and conn in self._greetings.all:
                self._greeting_readable(conn, READ)
                if conn in self._greetings.all:
                    return conn
            elif conn.allocation is not None and conn.stage is conn.allocation.pending:
                self._first_bytes(conn, READ)
                if conn.stage is conn.allocation.pending:
                    return conn
        return None

    def _idlest_client(self, conns: list[_Conn]) -> _Conn | None:
        """Whom a full cap on clients evicts: the oldest silent one, else the splice idle longest,
        else (no other) the one waiting longest for a parked connection."""
        silent = self._oldest_silent(conn for conn in conns if conn.stage is conn.allocation.pending)
        if silent is not None:
            return silent
        held = [conn for conn in conns if conn.stage is not None]  # reading the others may have dropped some
        return _idlest_splice(conn for conn in held if conn.splice is not None) or next(iter(held), None)

    # --- the agent port ---

    def _agent_connected(self, sock: socket.socket, source: str) -> None:
        self._sockets += 1
        self.accepted += 1
        greeting = _Conn(sock, source, time.monotonic())
        if len(self._greetings) >= MAX_GREETING:
            self._evict(self._oldest_silent(self._greetings.all), "the agent port's greeting cap")
        if len(self._greetings.of(source)) >= MAX_GREETING_PER_ADDRESS:
            self._evict(self._oldest_silent(self._greetings.of(source)), "the agent port's cap per address")
        if not self._make_room():
            self._refuse(sock)
            return
        self._greetings.add(greeting)
        self._unproven[greeting] = True
        self._loop.watch(sock, READ, partial(self._greeting_readable, greeting))

    def _greeting_readable(self, greeting: _Conn, mask: int) -> None:
        try:
            data = greeting.sock.recv(LINE_MAX + 1 - len(greeting.data))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        greeting.data += data
        line, newline, rest = greeting.data.partition(b"\n")
        if not newline and data and len(greeting.data) <= LINE_MAX:
            return  # more to come
        self._greetings.discard(greeting)
        self._unproven.pop(greeting, None)
        words = line.split() if newline else []
        if words == [KEY_REQUEST] and self.key_line:
            self._answer_key(greeting.sock)
        elif len(words) == 2 and words[0] == b"AGENT" and not rest:
            self._park(greeting.sock, words[1].decode(errors="replace"))
        else:
            self._warn.warning("bad line", "relay: refused a connection that sent no KEY or AGENT line")
            self._refuse(greeting.sock)

    def _answer_key(self, sock: socket.socket) -> None:
        try:
            sock.send(KEY_REPLY + self.key_line.encode() + b"\n")
        except OSError:
            pass
        self._close_socket(sock)

    def _park(self, sock: socket.socket, token: str) -> None:
        with self._lock:
            allocation = self._allocations.get(token)
        if allocation is None or allocation.closed:
            self._warn.warning("no allocation", "relay: refused a connection that named no allocation")
            self._refuse(sock)
            return
        if len(allocation.parked) >= MAX_PARKED:
            self._refuse(sock)
            return
        try:
            _tune(sock)
        except OSError:
            self._refuse(sock)
            return
        allocation.parked[sock] = True
        allocation.last_used = time.monotonic()
        self._loop.watch(sock, READ, partial(self._parked_gone, allocation, sock))
        self._pair(allocation)

    def _parked_gone(self, allocation: _Allocation, sock: socket.socket, mask: int) -> None:
        """A parked connection became readable: its agent is gone (or broke the protocol)."""
        allocation.parked.pop(sock, None)
        self._close_socket(sock)

    # --- an allocation's public port ---

    def _client_connected(self, allocation: _Allocation, sock: socket.socket, source: str) -> None:
        self._sockets += 1
        self.accepted += 1
        client = _Conn(sock, source, time.monotonic(), allocation)
        if len(allocation.clients.of(source)) >= MAX_CLIENTS_PER_ADDRESS:
            self._evict(self._idlest_client(allocation.clients.of(source)), "an allocation's cap per address")
        if len(allocation.pending) >= MAX_PENDING:
            self._evict(self._oldest_silent(allocation.pending), "an allocation's cap on silent clients")
        if allocation.closed or not self._make_room():
            self._refuse(sock)
            return
        self._enter(client, allocation.pending)
        self._unproven[client] = True
        self._loop.watch(sock, READ, partial(self._first_bytes, client))

    def _first_bytes(self, client: _Conn, mask: int) -> None:
        try:
            data = client.sock.recv(FIRST_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # it left before sending anything
            self._drop(client)
            return
        allocation = client.allocation
        self._loop.unwatch(client.sock)
        self._unproven.pop(client, None)
        if len(allocation.waiting) >= MAX_WAITING:
            self._evict(next(iter(allocation.waiting)), "an allocation's cap on waiting clients")
        client.data, client.since = data, time.monotonic()
        self._enter(client, allocation.waiting)
        self._pair(allocation)

    def _enter(self, client: _Conn, stage: dict) -> None:
        if client.stage is not None:
            del client.stage[client]
        else:
            client.allocation.clients.add(client)
        stage[client] = True
        client.stage = stage

    def _pair(self, allocation: _Allocation) -> None:
        """Join waiting clients, oldest first, to parked agent connections."""
        while allocation.waiting and allocation.parked:
            agent = next(iter(allocation.parked))
            del allocation.parked[agent]
            self._loop.unwatch(agent)
            if not _alive(agent):
                self._close_socket(agent)
                continue
            self._make_room_for_splice(allocation)  # evicts a spliced client, never a waiting one
            self._splice(next(iter(allocation.waiting)), agent)

    def _splice(self, client: _Conn, agent: socket.socket) -> None:
        try:
            _tune(client.sock)
        except OSError:
            pass  # it is gone: the splice will find out
        self._enter(client, client.allocation.spliced)
        client.splice = self._splicer.join(client.sock, agent, partial(self._unspliced, client), GO + client.data)
        client.data = b""
        self._splices += 1
        self.spliced += 1
        client.splice.start()

    def _unspliced(self, client: _Conn, splice: Splice) -> None:
        allocation = client.allocation
        allocation.spliced.pop(client, None)
        client.stage = None
        allocation.clients.discard(client)
        allocation.last_used = time.monotonic()
        self._splices -= 1
        self._sockets -= 2

    # --- timers ---

    def _expire(self) -> None:
        """Drop greetings, silent clients and waiting clients past their deadlines."""
        now = time.monotonic()
        _expire(self._greetings.all, now - GREETING_TIME, self._drop_late)
        for allocation in self._live_allocations():
            _expire(allocation.pending, now - FIRST_BYTES_TIME, self._drop_late)
            _expire(allocation.waiting, now - self.client_wait, self._drop_late)

    def _drop_late(self, conn: _Conn) -> None:
        self.refused += 1
        self._drop(conn)

    def _sweep(self) -> None:
        """Close allocations nobody has served for idle_close, and those of providers that did not
        register within SETTLE_TIME."""
        now = time.monotonic()
        idle = []
        for allocation in self._live_allocations():
            if allocation.parked or allocation.spliced:
                allocation.last_used = now
            if not allocation.settled and now - allocation.opened > SETTLE_TIME:
                idle.append(allocation)
            elif now - allocation.last_used > self.idle_close and not (allocation.parked or allocation.spliced):
                idle.append(allocation)
        with self._lock:
            for allocation in idle:
                self._allocations.pop(allocation.token, None)
        for allocation in idle:
            why = "its provider did not register" if not allocation.settled else "nobody serves it any more"
            log.info("relay: allocation on port %d closed (%s)", allocation.port, why)
            self._close_allocation(allocation)


def _idlest_splice(conns: Iterable[_Conn]) -> _Conn | None:
    """The spliced client whose splice has moved no byte for longest."""
    return min(conns, key=_Conn.idle_since, default=None)


def _expire(group: dict[_Conn, bool], before: float, drop: Callable[[_Conn], None]) -> None:
    """Drop the connections of ``group`` (oldest first) that came before ``before``."""
    while group:
        oldest = next(iter(group))
        if oldest.since > before:
            return
        drop(oldest)


class RelayAgent:
    """This side of an allocation: keeps ``parked`` connections parked at the relay and joins each
    one a client takes to the local server at ``local`` (HOST:PORT on this machine), all in one
    thread; at most AGENT_MAX relay connections at once. ``lost`` is set when the relay keeps
    closing parked connections before any client came (it no longer knows the token: restarted,
    or the allocation was closed); the agent then stops."""

    def __init__(self, relay: str, token: str, local: str, parked: int = PARKED):
        self.relay = _host_port(relay)
        self.token = token
        self.local = _host_port(local)
        self.parked = parked
        self.lost = threading.Event()
        self._loop = Loop("relay-agent", on_stop=self._close_everything)
        self._splicer: Splicer | None = None
        self._sockets: set[socket.socket] = set()  # dialing, parked and joining connections
        self._splices: set[Splice] = set()
        self._parking = 0  # slots dialing, parked, or waiting to try again
        self._joining = 0  # taken by a client, dialing the local server
        self._failures = 0
        self._refusals = 0
        self._closing = False

    def start(self) -> None:
        """Start parking connections, in the agent's thread."""
        self._splicer = Splicer(self._loop, AGENT_PIPES)
        self._loop.start()
        self._loop.call_soon(self._park_more)

    def stop(self) -> None:
        """Close every connection of the agent's (back when this returns)."""
        self._loop.stop()

    # --- everything below runs in the agent's thread ---

    def _park_more(self) -> None:
        while (not self._closing and self._parking < self.parked
               and self._parking + self._joining + len(self._splices) < AGENT_MAX):
            self._parking += 1
            self._track(dial(self._loop, self.relay, self._relay_dialed))

    def _track(self, sock: socket.socket | None) -> None:
        if sock is not None:
            self._sockets.add(sock)

    def _close(self, sock: socket.socket) -> None:
        self._sockets.discard(sock)
        self._loop.unwatch(sock)
        close_socket(sock)

    def _retry_later(self, delay: float) -> None:
        """This parking slot tries again in ``delay`` seconds."""
        def retry() -> None:
            self._parking -= 1
            self._park_more()
        self._loop.call_later(delay, retry)

    def _relay_dialed(self, sock: socket.socket | None, error: OSError | None) -> None:
        if error is None:
            try:
                sock.send(f"AGENT {self.token}\n".encode())
                _tune(sock)
            except OSError as exc:
                error = exc
                self._close(sock)
        if error is not None:
            self._sockets.discard(sock)
            self._failures += 1
            if self._failures in (1, 10):
                log.warning("relay %s:%d cannot be reached (%s): retrying", *self.relay, error)
            self._retry_later(min(5.0, 0.2 * self._failures))
            return
        self._failures = 0
        self._loop.watch(sock, READ, partial(self._relay_said, sock))

    def _relay_said(self, sock: socket.socket, mask: int) -> None:
        """The relay sent the go-byte (a client took this connection) or closed it."""
        try:
            byte = sock.recv(1)
        except BlockingIOError:
            return
        except OSError:  # broken (keepalives): try again
            self._close(sock)
            self._retry_later(0.2)
            return
        if byte != GO:
            self._close(sock)
            self._refused()
            return
        self._loop.unwatch(sock)
        self._refusals = 0
        self._parking -= 1
        self._joining += 1
        self._park_more()
        self._track(dial(self._loop, self.local, partial(self._local_dialed, sock)))

    def _local_dialed(self, upstream: socket.socket, local: socket.socket | None, error: OSError | None) -> None:
        self._joining -= 1
        self._sockets.discard(upstream)
        self._sockets.discard(local)
        if error is None:
            try:
                _tune(local)
            except OSError as exc:
                error = exc
                close_socket(local)
        if error is not None:
            log.debug("relay agent: the local server %s:%d cannot be reached (%s)", *self.local, error)
            close_socket(upstream)
            self._park_more()
            return
        splice = self._splicer.join(upstream, local, self._unspliced)
        self._splices.add(splice)
        splice.start()

    def _unspliced(self, splice: Splice) -> None:
        self._splices.discard(splice)
        self._park_more()

    def _refused(self) -> None:
        self._refusals += 1
        if self._refusals < REFUSALS_LOST:
            self._retry_later(min(5.0, 0.2 * 2 ** min(self._refusals, 5)))
            return
        log.warning("relay %s:%d no longer knows this allocation (restarted, or closed it)", *self.relay)
        self.lost.set()
        self._loop.stop()

    def _close_everything(self) -> None:
        self._closing = True
        for splice in list(self._splices):
            splice.close()
        for sock in list(self._sockets):
            self._close(sock)
        if self._splicer is not None:
            self._splicer.close()


@dataclass
class Allocation:
    """A relay allocation held by this participant: its public address, the agent serving it,
    and ``close`` (stops the agent and gives the allocation back)."""

    address: str
    agent: RelayAgent
    close: Callable[[], None]


def hold_allocation(ask: Callable[[str, dict], dict], host: str, port: int, holder: Holder) -> Allocation:
    """Ask the bootstrap (``ask(kind, body) -> reply body``) for an allocation serving ``holder``
    (this provider's registration, or a task this participant is part of), and serve it with an
    agent for this machine's ``port`` (on ``host``, loopback if that is a wildcard)."""
    reply = ask("relay.open", {holder.kind: holder.name})
    token = field_of(reply, "token", str, max_len=64)
    address, relay = field_of(reply, "address", str, max_len=256), field_of(reply, "relay", str, max_len=256)
    agent = RelayAgent(relay, token, f"{'127.0.0.1' if is_wildcard(host) else host}:{port}")
    agent.start()

    def close() -> None:
        agent.stop()
        try:
            ask("relay.close", {"token": token})
        except NetworkError:
            pass  # the relay closes it on its own once nobody serves it
    return Allocation(address, agent, close)


def fetch_key_line(relay: str, timeout: float = 5.0) -> str:
    """The bootstrap's public key as its relay port announces it (unauthenticated: trust on first use).
    Unreachable where nothing takes the connection; NetworkError where something does but announces no key."""
    sock = _connect(relay, timeout)
    try:
        with sock:
            sock.sendall(KEY_REQUEST + b"\n")
            line = read_line(sock, timeout)
    except OSError as exc:
        raise NetworkError(f"cannot ask {relay} for the bootstrap's key: {exc}") from None
    if not line.startswith(KEY_REPLY):
        raise NetworkError(f"{relay} did not announce a bootstrap key")
    return line[len(KEY_REPLY):].decode(errors="replace").strip()


def refusal(address: str, timeout: float = 5.0) -> str | None:
    """Why nothing at ``HOST:PORT`` takes a TCP connection ("connection refused", "timed out"), or
    None where something does (the connection closed at once, nothing sent): tells a service that
    is not running from one that answers in a way the caller did not expect."""
    try:
        socket.create_connection(_host_port(address), timeout=timeout).close()
    except OSError as exc:
        return _reason(exc)
    return None


def _connect(address: str, timeout: float) -> socket.socket:
    """A TCP connection to ``HOST:PORT``; Unreachable, saying why, where none is made."""
    try:
        return socket.create_connection(_host_port(address), timeout=timeout)
    except OSError as exc:
        raise Unreachable(f"cannot connect to {address}: {_reason(exc)}") from None


def _reason(exc: OSError) -> str:
    """What a failed connection met, in words: "connection refused", "timed out"."""
    return (exc.strerror or str(exc) or type(exc).__name__).lower()


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise PortInUseError(f"port {port} on {host} is in use: give the relay another port") from None
    sock.listen(LISTEN_BACKLOG)
    return sock
