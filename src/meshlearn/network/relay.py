"""Reaching a participant behind NAT: a relay both sides dial out to, splicing TCP byte streams.

The pattern of TURN allocations and Tailscale's DERP: a participant that cannot accept
connections asks the relay for an *allocation*, a public port of the relay, and keeps a few
*agent* connections parked at the relay's agent port (dialed out, so NAT lets them through). A
client connects to the allocation's port as if it were the participant; the relay hands the
connection a parked agent connection, and from then on copies bytes both ways. The agent
connects to the participant's own server on this machine and copies bytes too.

The relay sees only what flows inside: CurveZMQ sessions and sealed engine messages, encrypted
end to end between the client and the participant (the relay holds no key), so it learns sizes
and timing only. The agent port also answers ``KEY``: the bootstrap's public key, for trust on
first use.

Everything a peer can make the relay hold is capped (the constants below, docs/security.md);
parked connections carry TCP keepalives, and the relay drops those whose agent is gone, so an
allocation nobody serves any more is closed after IDLE_CLOSE.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from meshlearn.errors import NetworkError, PortInUseError
from meshlearn.network.addresses import is_wildcard
from meshlearn.network.envelope import field_of
from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)

PARKED = 4  # agent connections an allocation keeps waiting at the relay
# Caps on what one participant, or anyone who can connect, makes the relay hold (docs/security.md)
MAX_PARKED = 16  # parked agent connections per allocation
MAX_WAITING = 32  # clients waiting for a parked connection, per allocation
MAX_SPLICES = 64  # live spliced connections per allocation (and per agent)
MAX_SPLICES_TOTAL = 512  # live spliced connections of the whole relay
MAX_GREETING = 64  # connections to the agent port not yet past their first line
MAX_PER_OWNER = 8  # live allocations per participant key
GREETING_TIME = 5.0  # seconds a connection to the agent port has to send its whole first line
CLIENT_WAIT = 10.0  # seconds a client waits for a parked agent connection
IDLE_CLOSE = 120.0  # an allocation with neither a parked nor a spliced connection for this long is closed
SWEEP_EVERY = 5.0
REFUSALS_LOST = 5  # parked connections closed in a row before any client came: the relay forgot the token
LINE_MAX = 128
BUFFER = 1 << 20
GO = b"G"
KEY_REQUEST = b"KEY"
KEY_REPLY = b"meshlearn-bootstrap-key "


def pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes from ``source`` to ``sink`` until either side closes; then shut both down.
    On Linux the bytes never enter Python: ``os.splice`` moves them through a pipe in the kernel
    (a relayed exchange then costs about 1.2x a direct one instead of 1.4x, benchmarks/RESULTS.md)."""
    try:
        if hasattr(os, "splice"):
            _pump_in_kernel(source, sink)
        else:
            _pump_through_buffer(source, sink)
    except OSError:
        pass
    finally:
        for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def _pump_in_kernel(source: socket.socket, sink: socket.socket) -> None:
    read_end, write_end = os.pipe()
    try:
        try:
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, BUFFER)
        except OSError:
            pass  # above /proc/sys/fs/pipe-max-size: the default 64 KiB pipe
        while True:
            count = os.splice(source.fileno(), write_end, BUFFER)
            if not count:
                return
            while count:
                count -= os.splice(read_end, sink.fileno(), count)
    finally:
        os.close(read_end)
        os.close(write_end)


def _pump_through_buffer(source: socket.socket, sink: socket.socket) -> None:
    buffer = bytearray(BUFFER)
    view = memoryview(buffer)
    while True:
        count = source.recv_into(buffer)
        if not count:
            return
        sink.sendall(view[:count])


def splice(a: socket.socket, b: socket.socket, name: str, done: Callable[[], None] | None = None) -> None:
    """Copy both ways between two connected sockets, in two threads; close both, then call
    ``done``, when either side is finished."""
    def run():
        back = threading.Thread(target=pump, args=(b, a), name=f"{name}-back", daemon=True)
        back.start()
        pump(a, b)
        back.join()
        a.close()
        b.close()
        if done is not None:
            done()
    threading.Thread(target=run, name=name, daemon=True).start()


def _tune(sock: socket.socket) -> None:
    """Blocking without a timeout (os.splice needs it, and a relayed peer may be quiet for long),
    no Nagle delay, and TCP keepalives, so a connection whose other end vanished (a home router
    that forgot it) is noticed within a minute or so instead of never."""
    sock.settimeout(None)
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


def _gone(sock: socket.socket) -> bool:
    """Whether a parked connection is closed or broken (a parked agent never sends anything)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)  # EOF, an error, or bytes an agent should not send: all unusable
    except (OSError, ValueError):
        return True


@dataclass
class _Allocation:
    token: str
    listener: socket.socket
    port: int
    owner: str = ""
    parked: deque = field(default_factory=deque)
    arrived: threading.Condition = field(default_factory=threading.Condition)
    last_used: float = field(default_factory=time.monotonic)  # last time it had a parked or spliced connection
    waiting: int = 0
    splices: int = 0
    closed: bool = False


class Relay:
    """The relay: an agent port (plus ``KEY``) and one public port per allocation."""

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
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._greeting = threading.BoundedSemaphore(MAX_GREETING)
        self._warn = SparseLog(log)
        self._splices = 0
        self.spliced = 0
        self.refused = 0  # connections turned away by a cap, a late line, or for naming no allocation

    def bind(self) -> int:
        self._listener = _listen(self.host, self.port)
        self.port = self._listener.getsockname()[1]
        return self.port

    @property
    def address(self) -> str:
        return f"{self.public_host}:{self.port}"

    def start(self) -> None:
        if self._listener is None:
            self.bind()
        threading.Thread(target=self._accept_agents, name="relay-agents", daemon=True).start()
        threading.Thread(target=self._sweep, name="relay-sweep", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            _close(self._listener)
        with self._lock:
            allocations = list(self._allocations.values())
            self._allocations.clear()
        for allocation in allocations:
            self._close(allocation)

    def allocate(self, owner: str = "") -> tuple[str, str]:
        """A new allocation for ``owner`` (a participant's key): (token its agents present, public
        HOST:PORT clients connect to). At most MAX_PER_OWNER live ones per owner."""
        with self._lock:
            if owner and sum(a.owner == owner for a in self._allocations.values()) >= MAX_PER_OWNER:
                raise NetworkError(f"this key holds {MAX_PER_OWNER} relay allocations already: close one first")
            listener = None
            for port in (self.ports or [0]):
                try:
                    listener = _listen(self.host, port)
                    break
                except PortInUseError:
                    continue
            if listener is None:
                raise NetworkError("the relay has no free port left: widen --relay-ports")
            allocation = _Allocation(secrets.token_hex(16), listener, listener.getsockname()[1], owner)
            self._allocations[allocation.token] = allocation
        threading.Thread(target=self._accept_clients, args=(allocation,), name=f"relay-{allocation.port}",
                         daemon=True).start()
        return allocation.token, f"{self.public_host}:{allocation.port}"

    def release(self, token: str, owner: str = "") -> bool:
        """Close the allocation ``token`` if ``owner`` holds it; whether it did."""
        with self._lock:
            allocation = self._allocations.get(token)
            if allocation is None or allocation.owner != owner:
                return False
            del self._allocations[token]
        self._close(allocation)
        return True

    def owner_of(self, address: str) -> str | None:
        """The owner of the live allocation whose public address is ``address`` (None: no such)."""
        with self._lock:
            for allocation in self._allocations.values():
                if f"{self.public_host}:{allocation.port}" == address:
                    return allocation.owner
        return None

    def _accept_agents(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._greeting.acquire(blocking=False):
                self.refused += 1
                conn.close()
                continue
            threading.Thread(target=self._greet, args=(conn,), name="relay-greet", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        try:
            words = read_line(conn).split()
        except OSError:  # TimeoutError included: the line came too slowly
            self.refused += 1
            conn.close()
            return
        finally:
            self._greeting.release()
        if words == [KEY_REQUEST] and self.key_line:
            try:
                conn.sendall(KEY_REPLY + self.key_line.encode() + b"\n")
            except OSError:
                pass
            conn.close()
            return
        with self._lock:
            allocation = self._allocations.get(words[1].decode(errors="replace")) \
                if len(words) == 2 and words[0] == b"AGENT" else None
        if allocation is None:
            self.refused += 1
            self._warn.warning("no allocation", "relay: refused a connection that named no allocation")
            conn.close()
            return
        _tune(conn)
        with allocation.arrived:
            if len(allocation.parked) >= MAX_PARKED or allocation.closed:
                self.refused += 1
                conn.close()
                return
            allocation.parked.append(conn)
            allocation.last_used = time.monotonic()
            allocation.arrived.notify()

    def _accept_clients(self, allocation: _Allocation) -> None:
        while not allocation.closed:
            try:
                client, _ = allocation.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(allocation, client), name="relay-connect",
                             daemon=True).start()

    def _connect(self, allocation: _Allocation, client: socket.socket) -> None:
        with allocation.arrived:
            full = allocation.waiting >= MAX_WAITING or allocation.splices >= MAX_SPLICES \
                or self._splices >= MAX_SPLICES_TOTAL
            if not full:
                allocation.waiting += 1
        if full:
            self.refused += 1
            client.close()
            return
        _tune(client)
        try:
            agent = self._take_parked(allocation, time.monotonic() + self.client_wait)
        finally:
            with allocation.arrived:
                allocation.waiting -= 1
        if agent is None:
            client.close()
            return
        with allocation.arrived:
            allocation.splices += 1
            self._splices += 1

        def done():
            with allocation.arrived:
                allocation.splices -= 1
                allocation.last_used = time.monotonic()
                self._splices -= 1
        self.spliced += 1
        splice(client, agent, f"relay-splice-{allocation.port}", done)

    def _take_parked(self, allocation: _Allocation, deadline: float) -> socket.socket | None:
        """A live parked agent connection, told to go (None if none came in time)."""
        while True:
            with allocation.arrived:
                while not allocation.parked and time.monotonic() < deadline and not allocation.closed:
                    allocation.arrived.wait(deadline - time.monotonic())
                if not allocation.parked:
                    return None
                agent = allocation.parked.popleft()
            if _gone(agent):
                agent.close()
                continue
            try:
                agent.sendall(GO)
                return agent
            except OSError:  # that parked connection died: take the next
                agent.close()

    def _sweep(self) -> None:
        while not self._stop.wait(self.sweep_every):
            now = time.monotonic()
            with self._lock:
                allocations = list(self._allocations.values())
            idle = []
            for allocation in allocations:
                with allocation.arrived:
                    for conn in [c for c in allocation.parked if _gone(c)]:
                        allocation.parked.remove(conn)
                        conn.close()
                    if allocation.parked or allocation.splices:
                        allocation.last_used = now
                    elif now - allocation.last_used > self.idle_close:
                        idle.append(allocation)
            with self._lock:
                for allocation in idle:
                    self._allocations.pop(allocation.token, None)
            for allocation in idle:
                log.info("relay: allocation on port %d closed (nobody serves it any more)", allocation.port)
                self._close(allocation)

    def _close(self, allocation: _Allocation) -> None:
        allocation.closed = True
        _close(allocation.listener)
        with allocation.arrived:
            while allocation.parked:
                allocation.parked.popleft().close()
            allocation.arrived.notify_all()


class RelayAgent:
    """This side of an allocation: keeps connections parked at the relay and joins each one a
    client takes to the local server at ``local`` (HOST:PORT on this machine). ``lost`` is set
    when the relay keeps closing parked connections before any client came (it no longer knows
    the token: restarted, or the allocation was closed); the agent then stops."""

    def __init__(self, relay: str, token: str, local: str, parked: int = PARKED):
        self.relay = _host_port(relay)
        self.token = token
        self.local = _host_port(local)
        self.parked = parked
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._open: set[socket.socket] = set()  # parked and spliced connections, closed by stop()
        self._splices = threading.BoundedSemaphore(MAX_SPLICES)
        self._refusals = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        for index in range(self.parked):
            threading.Thread(target=self._park, name=f"relay-agent-{index}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for sock in self._open:
                _close(sock)
            self._open.clear()

    def _track(self, sock: socket.socket) -> bool:
        """Remember ``sock`` for stop(); False (and closed) if the agent is stopping already."""
        with self._lock:
            if self._stop.is_set():
                sock.close()
                return False
            self._open.add(sock)
            return True

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            for sock in socks:
                self._open.discard(sock)

    def _park(self) -> None:
        """Keep one connection parked; when a client takes it, splice and park a fresh one."""
        failures = 0
        while not self._stop.is_set():
            self._splices.acquire()  # at most MAX_SPLICES live: a flood of clients cannot take all our fds
            try:
                upstream = socket.create_connection(self.relay, timeout=10)
            except OSError as exc:
                self._splices.release()
                failures += 1
                if failures in (1, 10):
                    log.warning("relay %s:%d cannot be reached (%s): retrying", *self.relay, exc)
                self._stop.wait(min(5.0, 0.2 * failures))
                continue
            failures = 0
            if not self._track(upstream):
                self._splices.release()
                return
            try:
                upstream.sendall(f"AGENT {self.token}\n".encode())
                _tune(upstream)
                if upstream.recv(1) != GO:
                    raise ConnectionAbortedError("the relay closed a parked connection")
                self._refusals = 0
                local = socket.create_connection(self.local, timeout=10)
            except OSError as exc:
                self._forget(upstream)
                upstream.close()
                self._splices.release()
                if isinstance(exc, ConnectionAbortedError) and not self._stop.is_set():
                    self._refused()
                self._stop.wait(min(5.0, 0.2 * 2 ** min(self._refusals, 5)))
                continue
            _tune(local)
            if not self._track(local):
                upstream.close()
                self._splices.release()
                return

            def done(a=upstream, b=local):
                self._forget(a, b)
                self._splices.release()
            splice(upstream, local, "relay-agent-splice", done)

    def _refused(self) -> None:
        with self._lock:
            self._refusals += 1
            lost = self._refusals >= REFUSALS_LOST
        if lost and not self.lost.is_set():
            log.warning("relay %s:%d no longer knows this allocation (restarted, or closed it)", *self.relay)
            self.lost.set()
            self.stop()


@dataclass
class Allocation:
    """A relay allocation held by this participant: its public address, the agent serving it,
    and ``close`` (stops the agent and gives the allocation back)."""

    address: str
    agent: RelayAgent
    close: Callable[[], None]


def hold_allocation(ask: Callable[[str, dict], dict], host: str, port: int) -> Allocation:
    """Ask the bootstrap (``ask(kind, body) -> reply body``) for an allocation, and serve it with
    an agent for this machine's ``port`` (on ``host``, loopback if that is a wildcard)."""
    reply = ask("relay.open", {})
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
    """The bootstrap's public key as its relay port announces it (unauthenticated: trust on first use)."""
    try:
        with socket.create_connection(_host_port(relay), timeout=timeout) as sock:
            sock.sendall(KEY_REQUEST + b"\n")
            line = read_line(sock, timeout)
    except OSError as exc:
        raise NetworkError(f"cannot ask {relay} for the bootstrap's key: {exc}") from None
    if not line.startswith(KEY_REPLY):
        raise NetworkError(f"{relay} did not announce a bootstrap key")
    return line[len(KEY_REPLY):].decode(errors="replace").strip()


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
    sock.listen(64)
    return sock


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
