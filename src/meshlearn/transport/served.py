"""Endpoints that answer their peers' requests from one serving thread: the base of gossip's pull
endpoint and of the leader's hub.

Over ZeroMQ TCP: the server is a ROUTER socket owned by a serving thread; this node's own
requests go through a ``Caller``, one DEALER per peer, owned by the one thread that calls. A
request is a REQUEST message whose ``iteration`` field carries the caller's request id; the
answer is a REPLY with the same id, so a late answer is recognised and dropped. DEALERs are
``ZMQ_IMMEDIATE``: a peer with no live connection (dead, not started yet, refusing) fails the
call at once (within ``CONNECT_WAIT`` on first contact) instead of costing its whole timeout,
while ZeroMQ keeps reconnecting in the background. There is no handshake, since peers may come
and go.

A subclass decides how each request is answered: at once, or *held* (one per peer) and answered
later from the serving thread, when its wait ends or the subclass says so. A closing endpoint
answers every held request, then goes on answering at once for ``CLOSE_GRACE``: a request
already on its way would otherwise cost its whole timeout, and (measured on a loaded machine) a
peer lost about one answer in four sent just before the connection closed, linger or not.

Nothing goes unanswered for want of a readable request: one that does not open (damaged or forged
on the way) is answered with a *refusal*, a REPLY whose metadata says ``{"status": "refused",
"reason": ...}``, with request id 0 (the request's own cannot be trusted), which a caller takes
as the answer to its one outstanding request; a caller that cannot open an answer takes that as a
refusal too. Either way the caller learns at once that its request must go again. A replay (a
copy of a request taken before) is dropped unanswered: the original gets its own answer. A
patient call also sends its request again every ``timeout`` seconds while it waits, in case the
request or its answer was lost on the way, so a server must take the same request twice as one.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from meshlearn.errors import TransportError, WireError
from meshlearn.threads import GuardedThread
from meshlearn.transport.allocator import tune_allocator
from meshlearn.transport.base import Endpoint
from meshlearn.transport.settings import TcpSettings
from meshlearn.transport.zmqsock import bind_router
from meshlearn.wire import Kind, Message
from meshlearn.wire.sealed import FrameSeal, ReplayedMessage, decode_for, encode_for

log = logging.getLogger(__name__)
_IDENTITY = struct.Struct("<I")
POLL_MS = 100
CONNECT_WAIT = 0.2  # seconds a call waits for a connection to a peer before giving up on it
RECONNECT_MAX_MS = 2000  # reconnects to a peer that is not up back off from 100 ms to this
LINGER_MS = 200  # on close, time for the last answers to leave
CLOSE_GRACE = 0.25  # seconds a closing server goes on answering requests, at once
MAX_REQUESTS_PER_WAKE = 64  # then the held requests get their turn, even under a flood
SMALL_REQUEST_BYTES = 64 * 1024
REFUSED = "refused"
ANY_REQUEST = 0  # the request id of a refusal whose request did not open (never a caller's own)
MAX_REASON = 200  # characters of a refusal's reason


def refusal(sender: int, request_id: int, reason: str) -> Message:
    """The answer to a refused request: a REPLY that says so, and why."""
    return Message(Kind.REPLY, sender, request_id, 0, {}, {"status": REFUSED, "reason": reason[:MAX_REASON]})


def is_refusal(reply: Message) -> bool:
    """Whether an answer says its request was refused (the peer could not open or use the request,
    or the answer could not be opened here): the request may be sent again at once."""
    return reply.meta.get("status") == REFUSED


@dataclass
class Held:
    """A request waiting to be answered: by ``deadline`` at the latest (a monotonic time)."""

    routing_id: Any
    request_id: int
    deadline: float
    tag: int = 0  # what the subclass needs to judge it (gossip: the state version it has seen)


class ServedEndpoint(Endpoint):
    """A node endpoint that serves requests from one thread and makes its own through callers."""

    def __init__(self, node_id: int, host: str = "127.0.0.1", port: int = 0, *, settings: TcpSettings | None = None,
                 secret: bytes | None = None, max_request_bytes: int | None = None, seal: FrameSeal | None = None):
        super().__init__(node_id)
        self.seal = seal  # network tasks: every message encrypted with the task's key
        self.settings = settings or TcpSettings()
        self.host, self.port = host, port
        self.max_message_bytes = self.settings.max_message_bytes
        self.max_request_bytes = max_request_bytes or self.max_message_bytes
        self.secret = secret
        self.address = ""
        self.requests_served = 0
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None  # any thread -> serving thread
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._server: GuardedThread | None = None
        self._callers: list[Caller] = []

    # --- life cycle -------------------------------------------------------------------------

    def bind(self) -> str:
        tune_allocator()
        self._ctx = zmq.Context()
        try:
            self._router = bind_router(self._ctx, self.node_id, self.host, self.port, self.max_request_bytes)
        except Exception:
            self._ctx.term()
            self._ctx = None
            raise
        self._wake = socket.socketpair()
        for end in self._wake:
            end.setblocking(False)
        self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    def connect(self, peers: Mapping[int, str]) -> None:
        """Remember the peers and start serving; no handshake (peers may be down and come back)."""
        if self._router is None:
            raise TransportError("bind() must be called before connect()")
        self.peers = dict(peers)
        if self._server is None:
            self._server = self.start_thread(self._serve, type(self).__name__)

    def add_peer(self, rank: int, address: str) -> None:
        """A peer that joined the group while it runs: served and callable from now on (safe from
        any thread: the book is replaced whole, never changed under a reader)."""
        self.take_in(rank, address)

    def caller(self) -> "Caller":
        """A new caller for one thread's requests to the peers (closed with the endpoint)."""
        if self._ctx is None:
            raise TransportError("bind() must be called before making requests")
        caller = Caller(self)
        self._callers.append(caller)
        return caller

    def poke(self) -> None:
        """Wake the serving thread, so it looks at its held requests again (from any thread)."""
        with self._wake_lock:
            if self._wake is not None:
                try:
                    self._wake[1].send(b"!")
                except OSError:  # BlockingIOError: the serving thread already has wake-ups to read
                    pass

    def close(self) -> None:
        """Stop serving (answering what is held on the way out) and close every caller."""
        self._stop.set()
        self.poke()
        self._before_close()
        if self._server is not None:
            self._server.join(timeout=5.0)
            self._server = None
        for caller in self._callers:  # their threads are done with them by now
            caller.close()
        self._callers.clear()
        if self._router is not None:
            self._router.close(linger=LINGER_MS)
            self._router = None
        with self._wake_lock:  # a poke from another thread must not write to a closed socket
            wake, self._wake = self._wake, None
        for end in wake or ():
            end.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _before_close(self) -> None:
        """Stop this endpoint's own calling threads (called by ``close`` before the callers close)."""

    # --- the serving thread -------------------------------------------------------------------

    @abstractmethod
    def _on_request(self, routing_id: Any, request: Message, held: dict[int, Held]) -> None:
        """Answer a valid request from a peer now (``_reply``) or hold it (``held[sender] = ...``)."""

    @abstractmethod
    def _answer_held(self, held: dict[int, Held], closing: bool) -> None:
        """Answer the held requests whose time has come (all of them when ``closing``)."""

    def _serve(self) -> None:
        router, wake = self._router, self._wake[0]
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        held: dict[int, Held] = {}  # by peer
        closing_until: float | None = None
        while closing_until is None or time.monotonic() < closing_until:
            if closing_until is None and self._stop.is_set():
                closing_until = time.monotonic() + CLOSE_GRACE
                self._answer_held(held, closing=True)
            deadlines = [h.deadline for h in held.values() if h.deadline < math.inf]
            deadlines += [closing_until] if closing_until else []
            wait_ms = POLL_MS
            if deadlines:
                wait_ms = min(wait_ms, max(0, math.ceil((min(deadlines) - time.monotonic()) * 1000)))
            events = dict(poller.poll(wait_ms))
            if wake.fileno() in events:
                _drain(wake)
            if router in events:
                for _ in range(MAX_REQUESTS_PER_WAKE):
                    if not self._take_request(router, held):
                        break
            self._answer_held(held, closing=closing_until is not None)

    def _take_request(self, router: zmq.Socket, held: dict[int, Held]) -> bool:
        """Read one request, if any is waiting, and hand it on (or refuse it). False when none was waiting."""
        try:
            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        self.stats.add(bytes_received=sum(len(f) for f in frames))
        routing_id = frames[0]
        try:
            request = decode_for(frames[1:], self.max_request_bytes, self.secret, self.seal, self.window)
        except ReplayedMessage as exc:  # a copy of a request taken before, which has its own answer
            self.drop_refused(exc, "a request")
            return True
        except WireError as exc:  # damaged or forged on the way: refused as the caller's outstanding request
            self.drop_refused(exc, "a request")
            self._send(routing_id, refusal(self.node_id, ANY_REQUEST, str(exc)))
            return True
        if request.kind != Kind.REQUEST or request.sender not in self.peers:
            self.stats.add(unknown_sender_dropped=1)
            return True
        try:
            self._on_request(routing_id, request, held)
        except WireError as exc:  # a request whose metadata does not make sense
            self.drop_refused(exc, f"a request from {request.sender}")
        except Exception:  # noqa: BLE001 - one bad request must not end the serving thread
            self.stats.add(malformed_dropped=1)
            log.exception("node %d: a request from %d could not be answered", self.node_id, request.sender)
        return True

    def _reply(self, routing_id: Any, request_id: int, tensors: Mapping[str, torch.Tensor] | None = None,
               meta: Mapping[str, Any] | None = None) -> None:
        """Answer one request (serving thread only); encoding only views the tensors."""
        self._send(routing_id, Message(Kind.REPLY, self.node_id, request_id, 0, dict(tensors or {}), dict(meta or {})))
        self.requests_served += 1

    def _send(self, routing_id: Any, message: Message) -> None:
        frames = encode_for(message, self.secret, self.seal)
        self._router.send_multipart([routing_id, *frames], copy=False)
        self.stats.add(messages_sent=1, bytes_sent=sum(memoryview(f).nbytes for f in frames))


class Caller:
    """One thread's requests to the endpoint's peers: a DEALER per peer, replies matched by id.

    Not thread-safe: each calling thread makes its own (``ServedEndpoint.caller()``). Each caller's
    sockets carry their own random routing id: a ROUTER drops a second connection that claims a
    routing id already connected, so two callers of one node must not share one. (The server
    knows the sender from the request itself, never from the routing id.)
    """

    def __init__(self, endpoint: ServedEndpoint):
        self.endpoint = endpoint
        self.routing_id = _IDENTITY.pack(endpoint.node_id) + os.urandom(4)
        self.calls = 0
        self.failures = 0  # calls that got no answer: timeout, or a dead or unreachable peer
        self.resends = 0  # requests sent again by patient calls
        self.refusals = 0  # calls answered with a refusal (their request or its answer did not open)
        self._dealers: dict[int, zmq.Socket] = {}
        self._monitors: dict[int, zmq.Socket] = {}
        # Ids start at random, so an answer meant for another node's caller, played to this one, is not taken.
        self._request_id = int.from_bytes(os.urandom(6), "big")
        self.self_connects = 0

    def call(self, peer: int, timeout: float, tensors: Mapping[str, torch.Tensor] | None = None,
             meta: Mapping[str, Any] | None = None, patience: Callable[[], bool] | None = None) -> Message | None:
        """Send a request to ``peer`` and return its answer, which may be a refusal (``is_refusal``:
        the request or its answer did not open on the way), or None if none comes in ``timeout``
        seconds, or the peer has no live connection. Past ``timeout`` the call goes on waiting while
        ``patience()`` holds, and sends the request again every ``timeout`` seconds."""
        endpoint = self.endpoint
        if endpoint._stop.is_set() or peer not in endpoint.peers:
            return None
        self.calls += 1
        self._request_id += 1
        fresh = peer not in self._dealers
        dealer = self._dealer(peer)
        request = Message(Kind.REQUEST, endpoint.node_id, self._request_id, 0, dict(tensors or {}), dict(meta or {}))
        try:
            # A new socket gets CONNECT_WAIT for its first handshake; a known peer whose connection
            # is down (gone, restarting) fails at once while ZeroMQ reconnects in the background.
            if not dealer.poll(int(min(timeout, CONNECT_WAIT) * 1000) if fresh else 0, zmq.POLLOUT):
                raise zmq.Again()  # no connection to the peer
            self._send(dealer, request)
            reply = self._answer(dealer, peer, request, timeout, patience)
            if reply is not None:
                return reply
        except zmq.ZMQError as exc:
            log.debug("node %d: request to %d failed: %s", endpoint.node_id, peer, exc)
        self.failures += 1
        self._connected_to_itself(peer)  # checked on failures only: it costs more than a fetch's own work
        return None

    def _answer(self, dealer: zmq.Socket, peer: int, request: Message, timeout: float,
                patience: Callable[[], bool] | None) -> Message | None:
        """The answer to ``request`` (sent), awaited ``timeout`` seconds and then while ``patience()``
        holds, sending the request again every ``timeout`` seconds; None if the wait ends without one."""
        deadline = resend_at = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if now >= deadline and (patience is None or not patience()):
                return None
            if now >= resend_at:  # the request, or its answer, may have been lost on the way
                resend_at = now + (timeout if self._resend(dealer, request) else POLL_MS / 1000)
            wait = deadline - now if now < deadline else min(POLL_MS / 1000, resend_at - now)
            if dealer.poll(max(1, int(wait * 1000))):
                reply = self._receive(dealer, peer)
                if reply is not None:
                    return reply

    def _send(self, dealer: zmq.Socket, request: Message) -> None:
        """Encode (seal) and send one request; a request sent again is sealed anew, so it is no replay."""
        frames = encode_for(request, self.endpoint.secret, self.endpoint.seal)
        dealer.send_multipart(frames, zmq.NOBLOCK, copy=False)
        self.endpoint.stats.add(messages_sent=1, bytes_sent=sum(memoryview(f).nbytes for f in frames))

    def _resend(self, dealer: zmq.Socket, request: Message) -> bool:
        """Send ``request`` again if the connection is up (else False: try again shortly)."""
        try:
            if not dealer.poll(0, zmq.POLLOUT):
                return False
            self._send(dealer, request)
        except zmq.Again:
            return False
        self.resends += 1
        return True

    def _receive(self, dealer: zmq.Socket, peer: int) -> Message | None:
        """The awaited answer from ``dealer``'s next message, or None if that message is not it: a
        refusal with id 0 answers the outstanding request, and an answer that does not open is
        taken as its refusal (a replay never is: it opened, and is an old answer)."""
        endpoint = self.endpoint
        frames = dealer.recv_multipart(copy=False)
        endpoint.stats.add(bytes_received=sum(len(f) for f in frames))
        try:
            reply = decode_for(frames, endpoint.max_message_bytes, endpoint.secret, endpoint.seal, endpoint.window)
        except ReplayedMessage as exc:
            endpoint.drop_refused(exc, f"an answer from {peer}")
            return None
        except WireError as exc:
            endpoint.drop_refused(exc, f"an answer from {peer}")
            reply = refusal(peer, self._request_id, f"the answer did not open: {exc}")
        else:
            awaited = reply.iteration == self._request_id or (reply.iteration == ANY_REQUEST and is_refusal(reply))
            if reply.kind != Kind.REPLY or reply.sender != peer or not awaited:
                endpoint.stats.add(stale_dropped=1)
                return None
            endpoint.stats.add(messages_received=1)
        self.refusals += is_refusal(reply)
        return reply

    def _dealer(self, peer: int) -> zmq.Socket:
        dealer = self._dealers.get(peer)
        if dealer is None:
            endpoint = self.endpoint
            dealer = endpoint._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.ROUTING_ID, self.routing_id)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IMMEDIATE, 1)  # no live connection: sending is refused, not queued
            dealer.setsockopt(zmq.MAXMSGSIZE, endpoint.max_message_bytes)
            dealer.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
            self._monitors[peer] = dealer.get_monitor_socket(zmq.EVENT_CONNECTED)
            dealer.connect(endpoint.peers[peer])
            self._dealers[peer] = dealer
        return dealer

    def _connected_to_itself(self, peer: int) -> bool:
        """Whether the connection to ``peer`` turned out to be a TCP self-connect (then every call
        to it fails: it gets its own request back); if so it is dropped, and a new one is made on
        the next call.

        Connecting again and again to a loopback port nobody listens on yet (a peer still
        starting) can, once in tens of thousands of tries, get that very port as its own source
        port: the kernel then connects the socket to itself, and the peer can never bind its port.
        dpwa-style ports (45000+) lie in Linux's ephemeral range, so this happens in practice.
        """
        monitor = self._monitors.get(peer)
        while monitor is not None:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return False
            try:
                with socket.socket(fileno=os.dup(event["value"])) as conn:
                    itself = conn.getsockname() == conn.getpeername()
            except OSError:  # already closed again: nothing to check
                continue
            if itself:
                self.self_connects += 1
                log.warning("node %d: the connection to %d at %s was a TCP self-connect; dropped it",
                            self.endpoint.node_id, peer, self.endpoint.peers[peer])
                self._drop(peer)
                return True
        return False

    def _drop(self, peer: int) -> None:
        dealer, monitor = self._dealers.pop(peer, None), self._monitors.pop(peer, None)
        if dealer is not None:
            dealer.disable_monitor()
            dealer.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)

    def close(self) -> None:
        for peer in list(self._dealers):
            self._drop(peer)


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except OSError:  # BlockingIOError: nothing more to read
        pass
