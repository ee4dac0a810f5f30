"""The engine links of a task run that cross a NAT: punched where both ends can, the relay otherwise.

A TCP engine dials each neighbour (a ZeroMQ DEALER to the neighbour's ROUTER). Where the
neighbour is behind NAT, this provider gives its engine a *front* instead of the neighbour's
relayed address: a port on loopback whose connections are carried over a path chosen per pair:

- *punched*: a TCP connection opened through both NATs at once (``channel.punch``), from this
  provider's ``out`` port to the neighbour's ``in`` port (each direction of a pair is punched on
  its own: a provider behind NAT is dialed that way too). Once both ends confirmed it
  (``punch.confirm``), an engine that holds one connection per neighbour takes it over: both
  ends reset it, and ``settle`` has this engine's DEALER connect from the ``out`` port to the
  neighbour's ``in`` port while the neighbour's ROUTER connects from there back (ZeroMQ's
  ``tcp://SOURCE;TARGET``): TCP's simultaneous open joins them again through the mappings the
  punch opened, with no hop on loopback (ZeroMQ connects the same way again if it ever breaks).
  Should that connect not carry ZeroMQ's handshake in time, the DEALER dials the front instead
  (``TcpTransport.fall_back``), which carries it over QUIC or the relay; so does a punch
  confirmed after the engine got its book. An engine that connects once per calling thread
  (served endpoints) dials its front, which carries the punched connection as it is, into the
  neighbour's engine;
- *quic*: where a TCP punch of the pair failed (a NAT or firewall that drops every unasked-for
  SYN) but UDP gets through: both sides punch a UDP path from the sockets whose mappings they
  named, and run QUIC over it (``channel.quicpath``: certificates pinned through the requester);
  each side's engine reaches the other's through it;
- *relayed*: a connection to the neighbour's relay allocation (as before punching existed), when
  either end is behind a NAT punching cannot cross, every punch failed (remembered for a while,
  ``PunchMemory``), or a punched connection broke (ZeroMQ connects again, and the front relays it).

The relay sees only sealed engine messages either way; what a link sent through it is counted
(``report``). Links to a neighbour that can be dialed stay direct and do not pass through here.
All sockets are served by one ``splicer.Loop``; each punch, and each QUIC path's start, is a short
thread around ``punch_tcp`` / ``punch_udp``.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import NetworkError
from meshlearn.network.channel.addresses import is_wildcard
from meshlearn.network.channel.punch import (
    ATTEMPT_TIME,
    CONFIRM_TIME,
    PUNCH_TIME,
    UDP_PUNCH_TIME,
    PunchMemory,
    PunchResult,
    confirm,
    engine_path,
    punch_tcp,
    punch_udp,
    reset_close,
)
from meshlearn.network.channel.quicpath import HANDSHAKE_TIMEOUT, QuicPath, role_for
from meshlearn.network.channel.relaywire import host_port, tune
from meshlearn.network.channel.splicer import Acceptor, Loop, Splice, Splicer, close_socket, dial
from meshlearn.network.protocol.providerapi import PunchPorts
from meshlearn.network.provider.natside import QuicSockets
from meshlearn.transport.base import Endpoint

log = logging.getLogger(__name__)
MAX_PIPES = 16  # kernel pipes the task's splices may hold at once (two per busy link direction)
MAX_PUNCHED_PAIRS = 16  # neighbours a provider punches paths to at once (two threads each); the rest: the relay
SETTLE_GRACE = ATTEMPT_TIME + CONFIRM_TIME + 0.5  # seconds past its punch time ``settle`` waits: a punch's last try, its confirmation
DIRECT, PUNCHED, QUIC, RELAYED, PUNCHING = "direct", "punched", "quic", "relayed", "punching"
ANNOUNCED = "announced"  # a neighbour that named no punching ports (one taken in mid-task): dialed where it said


def punchable(source: PunchPorts | None, target: PunchPorts | None) -> bool:
    """Whether the link from the provider with ``source`` to the one with ``target`` is punched:
    the target is behind NAT, and both named their hosts and ports (none does behind a symmetric NAT)."""
    return source is not None and target is not None and target.behind_nat and source.host is not None \
        and source.out_port is not None and target.in_port is not None and target.host is not None


def quic_possible(mine: PunchPorts | None, theirs: PunchPorts | None, me: int) -> bool:
    """Whether a pair can link over QUIC: both named a certificate, and the neighbour a host and a
    UDP port for provider ``me``."""
    return mine is not None and mine.quic_pin is not None and theirs is not None and theirs.quic_pin is not None \
        and theirs.host is not None and theirs.udp_port_for(me) is not None


def may_dial(host: str | None, mine: PunchPorts | None) -> bool:
    """Whether a punch may go to ``host``, a neighbour's public address as its task's requester
    passed it on: never this machine's loopback (a service here is no neighbour), unless this
    provider is reached on loopback itself (every provider on one machine)."""
    if host is None:
        return False
    address = ipaddress.IPv4Address(host)
    return not address.is_loopback or (mine is not None and mine.host is not None
                                        and ipaddress.IPv4Address(mine.host).is_loopback)


@dataclass
class EngineRoutes:
    """What a run's engine dials once its punches ended (``LinkPaths.settle``): ``book``, by
    neighbour; where its ROUTER connects to meet a neighbour's punched link (``meets``); and for
    each punched path it connects itself, the front to dial instead should that path not carry
    ZeroMQ's handshake within ``fallback_after`` seconds (``fallbacks``)."""

    book: dict[int, str]
    meets: dict[int, str] = field(default_factory=dict)
    fallbacks: dict[int, str] = field(default_factory=dict)
    fallback_after: float = 0.0

    def give(self, endpoint: Endpoint) -> dict[int, str]:
        """Tell ``endpoint`` (before its ``connect``) where it meets and falls back; the book it connects to."""
        for peer, address in self.meets.items():
            endpoint.meet(peer, address)
        for peer, address in self.fallbacks.items():
            endpoint.fall_back(peer, address, self.fallback_after)
        return self.book


@dataclass
class _Front:
    """The loopback port a link's engine connections come to, and how they go on."""

    listener: socket.socket
    relayed_at: tuple[str, int]  # the neighbour's relay allocation
    punched: socket.socket | None = None
    parked: list[socket.socket] = field(default_factory=list)  # connections waiting for the pair's punches
    path: str = PUNCHING  # the path the next connection takes (PUNCHING: none chosen yet)
    relay_bytes: int = 0  # bytes of finished relayed splices
    relaying: list[Splice] = field(default_factory=list)
    acceptor: Acceptor | None = None
    direct: bool = False  # the punched path is the engine's own to connect (``settle``): the front is its fallback

    def bytes_through_relay(self) -> int:
        return self.relay_bytes + sum(splice.moved for splice in self.relaying)


@dataclass
class _Pair:
    """This provider's links with one neighbour: the front of its own (where it dials a neighbour
    behind NAT), the TCP punches under way, and the QUIC path that carries what TCP could not."""

    index: int
    peer: str
    theirs: PunchPorts | None
    front: _Front | None = None
    pending: int = 0  # TCP punches under way
    failed: bool = False  # a TCP punch of the pair failed, or was not worth trying
    quic: QuicPath | None = None
    quic_port: int | None = None  # 127.0.0.1 port whose connections the QUIC path carries to the neighbour's engine
    settled: bool = False
    meets: bool = False  # the neighbour's link to this engine was punched: the engine's ROUTER meets it (``settle``)
    handed: bool = False  # ``settle`` gave the engine its book: a punch confirmed later is not the engine's
    punches_over: threading.Event = field(default_factory=threading.Event)  # no TCP punch of the pair under way


class LinkPaths:
    """One task run's fronts and punched links. ``route`` starts them and returns the book the
    engine dials; ``report`` says each link's path; ``close`` ends everything."""

    def __init__(self, me: int, bind_host: str, engine_port: int, mine: PunchPorts | None, memory: PunchMemory,
                 quic: QuicSockets | None = None, clock: Clock = SYSTEM, budget: float | None = None,
                 punch: Callable[..., PunchResult] = punch_tcp, here: tuple[int | None, int | None] | None = None,
                 engine_meets: bool = True):
        self.me = me  # this provider's index in the task
        self.bind_host = bind_host  # where this provider's punching ports are bound
        self.engine = ("127.0.0.1" if is_wildcard(bind_host) else bind_host, engine_port)  # where its engine listens
        self.engine_port = engine_port
        self.mine = mine
        # the punching ports on this machine (out, in): ``mine`` names their NAT's mappings, which may differ
        self.out_here, self.in_here = here or ((mine.out_port, mine.in_port) if mine else (None, None))
        self.memory = memory
        self.quic = quic or QuicSockets()
        self.clock = clock
        # seconds a TCP punch, a UDP punch and a QUIC handshake may each take: together at most 3/4 of
        # ``budget`` (the engine's handshake timeout), so a link that ends on the relay is there in time
        share = float("inf") if budget is None else budget / 4
        self.punch_time, self.udp_time, self.quic_time = (min(PUNCH_TIME, share), min(UDP_PUNCH_TIME, share),
                                                          min(HANDSHAKE_TIMEOUT, share))
        self.punch = punch  # ``punch_tcp``; tests give both ends of a pair one connection instead
        self.engine_meets = engine_meets  # whether the engine takes punched paths over (``Endpoint.meets``)
        self._loop = Loop("link-paths", on_stop=self._close_all)
        self._splicer = Splicer(self._loop, MAX_PIPES)
        self._pairs: dict[int, _Pair] = {}
        self._direct: dict[int, tuple[str, str]] = {}  # neighbours dialed where they said: (id, path)
        self._joined: list[Splice] = []  # punched links joined to a front's connection or to the engine
        self._cancelled = threading.Event()
        self._punching = 0  # pairs being punched (at most MAX_PUNCHED_PAIRS)

    def route(self, book: dict[int, str], ids: dict[int, str], punches: dict[int, PunchPorts]) -> dict[int, str]:
        """Start serving the links of ``book`` (engine addresses by index; ``ids``: the providers'
        ids, ``punches``: their punching ports, where they have some); the book the engine dials."""
        self._loop.start()
        routed = {}
        for index, address in book.items():
            theirs = punches.get(index)
            scheme, _, where = address.partition("://")
            pair = _Pair(index, ids.get(index, str(index)), theirs)
            crosses = scheme == "tcp" and theirs is not None and theirs.behind_nat
            if crosses:
                pair.front = self._open_front(pair, host_port(where))
                routed[index] = f"tcp://127.0.0.1:{pair.front.listener.getsockname()[1]}"
            else:
                self._direct[index] = (pair.peer, DIRECT if theirs is not None else ANNOUNCED)
                routed[index] = address
            if scheme == "tcp" and (crosses or (self.mine is not None and self.mine.behind_nat)):
                self._pairs[index] = pair
                self._loop.call_soon(partial(self._start_pair, pair))
        return routed

    def settle(self, book: dict[int, str]) -> EngineRoutes:
        """The engine's routes once the TCP punches ``route`` started ended (waited for, each within
        its punch time and SETTLE_GRACE, where the engine takes punched paths over): ``book`` (as
        ``route`` gave it) with each punched link the engine's own."""
        deadline = self.clock.monotonic() + self.punch_time + SETTLE_GRACE
        for pair in list(self._pairs.values()) if self.engine_meets else []:
            self.clock.wait(pair.punches_over, max(0.0, deadline - self.clock.monotonic()))
        routes: Future = Future()  # the loop makes every call handed to it, even one that comes as it stops

        def hand_over() -> None:
            try:
                routes.set_result(self._hand_over(book))
            except Exception as exc:  # a bug: the run fails with it, at once
                routes.set_exception(exc)
        if not self._loop.call_soon(hand_over):  # the task ended
            return EngineRoutes(book)
        return routes.result()

    def report(self) -> dict[str, dict]:
        """Each link this provider's engine dials, by neighbour id: its path (direct, punched, quic,
        relayed, or punching while under way) and the bytes it sent and received through the relay."""
        links = {peer: {"path": path, "relay_bytes": 0} for peer, path in list(self._direct.values())}
        for pair in list(self._pairs.values()):
            if pair.front is not None:
                links[pair.peer] = {"path": pair.front.path, "relay_bytes": pair.front.bytes_through_relay()}
        return links

    def close(self) -> None:
        """Stop punching, close every front, splice, punched socket and QUIC path; wait for the loop."""
        self._cancelled.set()
        self._loop.stop()  # on_stop closes what it holds, in the loop's thread (or here, if it never started)
        self._splicer.close()
        for pair in list(self._pairs.values()):
            if pair.quic is not None:
                pair.quic.close()
        self.quic.close()

    # ---- in the loop's thread ----------------------------------------------------------------

    def _start_pair(self, pair: _Pair) -> None:
        """Punch the pair's directions that cross a NAT (each side does the same for the pair)."""
        allowed = may_dial(pair.theirs.host if pair.theirs else None, self.mine) and self._punching < MAX_PUNCHED_PAIRS
        outward = allowed and pair.front is not None and punchable(self.mine, pair.theirs)
        inward = allowed and punchable(pair.theirs, self.mine)
        self._punching += outward or inward
        tcp = self.memory.worth_trying(pair.peer, "tcp")
        pair.failed = (outward or inward) and not tcp
        if tcp and outward:
            pair.pending += 1
            self._punch(pair, self.out_here, (pair.theirs.host, pair.theirs.in_port), partial(self._punched_out, pair), True)
        if tcp and inward:
            pair.pending += 1
            self._punch(pair, self.in_here, (pair.theirs.host, pair.theirs.out_port), partial(self._punched_in, pair), False)
        self._settle(pair)

    def _settle(self, pair: _Pair) -> None:
        """Once the pair's TCP punches are over: a QUIC path for what they could not do, or the
        front's connections on their way."""
        if pair.pending:
            return
        pair.punches_over.set()
        if pair.settled:
            return
        if pair.failed and not self._cancelled.is_set() and quic_possible(self.mine, pair.theirs, self.me) \
                and pair.index in self.quic.sockets and self.memory.worth_trying(pair.peer, "quic"):
            pair.settled = True
            threading.Thread(target=self._open_quic, args=(pair,), name=f"quic-{pair.peer}", daemon=True).start()
            return
        pair.settled = True
        self._release(pair)

    def _release(self, pair: _Pair) -> None:
        """The pair's paths are known: the front's waiting connections go on."""
        front = pair.front
        if front is None:
            return
        front.path = PUNCHED if front.punched is not None or front.direct else \
            QUIC if pair.quic_port is not None else RELAYED
        parked, front.parked = front.parked, []
        for sock in parked:
            self._carry(pair, sock)

    def _hand_over(self, book: dict[int, str]) -> EngineRoutes:
        """``settle``'s routes: each confirmed punched path the engine's own to connect, its front the fallback."""
        routes = EngineRoutes(dict(book), fallback_after=self.punch_time)
        for pair in self._pairs.values():
            pair.handed, front = True, pair.front
            if front is not None and front.direct and not front.parked:
                routes.book[pair.index] = engine_path((self.bind_host, self.out_here), (pair.theirs.host, pair.theirs.in_port))
                routes.fallbacks[pair.index] = book[pair.index]
            if pair.meets:
                routes.meets[pair.index] = engine_path((self.bind_host, self.in_here), (pair.theirs.host, pair.theirs.out_port))
        return routes

    def _open_front(self, pair: _Pair, relayed_at: tuple[str, int]) -> _Front:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        front = _Front(listener, relayed_at)
        front.acceptor = Acceptor(self._loop, listener, lambda sock, _ip: self._arrived(pair, sock), f"front-{pair.peer}")
        self._loop.call_soon(front.acceptor.start)
        return front

    def _arrived(self, pair: _Pair, sock: socket.socket) -> None:
        """The engine dialed the neighbour: its connection goes on now, or once the punches ended."""
        if pair.front.path == PUNCHING:
            pair.front.parked.append(sock)
        else:
            self._carry(pair, sock)

    def _carry(self, pair: _Pair, sock: socket.socket) -> None:
        front = pair.front
        punched, front.punched = front.punched, None
        if punched is not None:
            front.path = PUNCHED
            self._joined.append(self._join(sock, punched, self._joined_done))
            return
        if pair.quic_port is not None and not pair.quic.ended.is_set():
            front.path = QUIC
            self._dial_and_join(sock, ("127.0.0.1", pair.quic_port), self._joined, f"the QUIC path to {pair.peer}")
            return
        front.path = RELAYED
        self._dial_and_join(sock, front.relayed_at, front.relaying, f"the relay for {pair.peer}",
                            partial(self._relay_done, front))

    def _dial_and_join(self, sock: socket.socket, target: tuple[str, int], into: list[Splice], what: str,
                       done: Callable[[Splice], None] | None = None) -> None:
        def dialed(other: socket.socket | None, error: OSError | None) -> None:
            if error is not None:
                log.info("link: %s does not answer (%s)", what, error)
                close_socket(sock)
                return
            into.append(self._join(sock, other, done or self._joined_done))
        dial(self._loop, target, dialed)

    def _relay_done(self, front: _Front, splice: Splice) -> None:
        if splice in front.relaying:
            front.relaying.remove(splice)
            front.relay_bytes += splice.moved

    def _join(self, a: socket.socket, b: socket.socket, done: Callable[[Splice], None]) -> Splice:
        for sock in (a, b):
            sock.setblocking(False)
            tune(sock)
        splice = self._splicer.join(a, b, done)
        splice.start()
        return splice

    def _punched_out(self, pair: _Pair, result: PunchResult) -> None:
        pair.pending -= 1
        pair.failed |= result.sock is None
        if result.sock is not None and self.engine_meets:  # confirmed: the engine connects between these ports
            reset_close(result.sock)
            pair.front.direct = True
        else:
            pair.front.punched = result.sock
        self._settle(pair)

    def _punched_in(self, pair: _Pair, result: PunchResult) -> None:
        """A neighbour's link to this provider was punched (or not): join it to this provider's engine."""
        pair.pending -= 1
        pair.failed |= result.sock is None
        if result.sock is not None and self.engine_meets:  # confirmed: the engine's ROUTER meets it (unless too late)
            reset_close(result.sock)
            pair.meets = not pair.handed
        elif result.sock is not None:
            self._dial_and_join(result.sock, self.engine, self._joined, "this provider's engine")
        self._settle(pair)

    def _quic_opened(self, pair: _Pair, path: QuicPath | None, local_port: int | None) -> None:
        pair.quic, pair.quic_port = path, local_port
        self._release(pair)

    def _joined_done(self, splice: Splice) -> None:
        if splice in self._joined:
            self._joined.remove(splice)

    def _close_all(self) -> None:
        for pair in self._pairs.values():
            front = pair.front
            if front is None:
                continue
            if front.acceptor is not None:
                front.acceptor.close()
            for sock in [*front.parked, *([front.punched] if front.punched is not None else [])]:
                close_socket(sock)
            for splice in list(front.relaying):
                splice.close()
        for splice in list(self._joined):
            splice.close()

    # ---- threads -----------------------------------------------------------------------------

    def _punch(self, pair: _Pair, port: int, target: tuple[str, int], then: Callable[[PunchResult], None],
               outward: bool) -> None:
        """Punch from ``port`` to ``target`` in a thread of its own (``outward``: this engine's link, not
        the neighbour's), confirmed where the engine takes it over; ``then(result)`` in the loop."""
        deadline = self.clock.monotonic() + self.punch_time

        def work() -> None:
            try:
                result = self.punch((self.bind_host, port), target, deadline, self.clock, cancelled=self._cancelled)
            except Exception as exc:  # a bug, or an address the system refuses: the pair goes on without it
                result = PunchResult(None, 0, f"{type(exc).__name__}: {exc}")
            if result.sock is not None and self.engine_meets and not confirm(result.sock, outward):
                result.sock.close()  # the ends do not agree they hold it: not the engines' to take over
                result = PunchResult(None, result.tries, "the other end did not confirm the punch")
            if self._cancelled.is_set():
                pass  # the task ended: says nothing of the pair
            elif result.sock is None:
                self.memory.failed(pair.peer, "tcp")
                log.info("link with %s: no TCP path through the NATs (%s after %d tries)", pair.peer, result.why,
                         result.tries)
            else:
                self.memory.worked(pair.peer, "tcp")
            if not self._loop.call_soon(partial(then, result)) and result.sock is not None:
                result.sock.close()
        threading.Thread(target=work, name=f"punch-{pair.peer}", daemon=True).start()

    def _open_quic(self, pair: _Pair) -> None:
        """Punch a UDP path to the neighbour and open QUIC over it (a thread of its own)."""
        sock = self.quic.take(pair.index)
        target = (pair.theirs.host, pair.theirs.udp_port_for(self.me))
        path = local_port = None
        if sock is None:  # closed meanwhile: the task ended
            return
        if punch_udp(sock, target, self.clock.monotonic() + self.udp_time, self.clock, self._cancelled):
            own, theirs = self.mine.quic_pin, pair.theirs.quic_pin
            path = QuicPath(sock, target, role_for(own.encode(), theirs.encode()), self.quic.certificate,
                            bytes.fromhex(theirs), handshake_timeout=self.quic_time)
            try:
                local_port = path.expose_local(*reversed(self.engine))
                path.start()
                self.memory.worked(pair.peer, "quic")
            except (NetworkError, OSError) as exc:
                path.close()
                log.info("link with %s: no QUIC path either (%s): the relay carries it", pair.peer, exc)
                path = local_port = None
        else:
            sock.close()
            log.info("link with %s: no UDP path through the NATs either: the relay carries it", pair.peer)
        if path is None and not self._cancelled.is_set():
            self.memory.failed(pair.peer, "quic")
        if not self._loop.call_soon(partial(self._quic_opened, pair, path, local_port)) and path is not None:
            path.close()
