"""Pull exchange for gossip: every node serves its latest published state to any peer that asks,
from a background thread, and fetches one peer's state at a time without blocking training.

Over ZeroMQ TCP: the server is a ROUTER socket owned by a serving thread; each fetch is a REQUEST
message on a DEALER socket (one per peer, owned by a single fetch thread) answered by a REPLY
carrying the state and its ``clock`` and ``loss`` in the message metadata. DEALERs are
``ZMQ_IMMEDIATE``: a peer with no live connection (dead, not started yet, refusing) fails the
fetch at once (within ``CONNECT_WAIT`` on first contact) instead of costing its whole timeout,
while ZeroMQ keeps reconnecting in the background. A peer that answers late costs the timeout;
its late answer is recognised by its request id and discarded. There is no handshake, since
gossip peers may come and go.

A request may ask the server to *hold* it for up to ``wait`` seconds (its metadata): the server
answers with the last state it publishes within the wait (when it publishes a newer state and
does not expect to publish another before the wait ends, judging by its recent publications), or
with the state it has when the wait ends. A fetcher that asks when its own step starts and needs
the answer when the step ends thus gets the newest state its peer finishes in the meantime, not
one that is already a step old. Held requests are kept one per peer (a newer request from the
same peer replaces an unanswered one), never longer than ``MAX_HOLD``, and answered when the
server closes.
"""

from __future__ import annotations

import logging
import math
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping

import torch
import zmq

from meshlearn.errors import TransportError, WireError
from meshlearn.transport.allocator import tune_allocator
from meshlearn.transport.base import Endpoint
from meshlearn.transport.zmqsock import bind_router
from meshlearn.wire import DEFAULT_MAX_BYTES, Kind, Message, decode, encode, meta_number

log = logging.getLogger(__name__)
_IDENTITY = struct.Struct("<I")
POLL_MS = 100
CONNECT_WAIT = 0.2  # seconds a fetch waits for a connection to a peer before giving up on it
LINGER_MS = 200  # on close, time for the answers to held requests to leave
CLOSE_GRACE = 0.25  # seconds a closing server goes on answering requests, at once
MAX_HOLD = 10.0
MAX_REQUESTS_PER_WAKE = 64  # seconds a server holds a request for a newer state, whatever the request asks


@dataclass
class _Held:
    """A request waiting for a state newer than ``version`` (or for ``deadline``)."""

    routing_id: object
    request_id: int
    version: int
    deadline: float


class PullEndpoint(Endpoint):
    """A node's gossip endpoint: ``publish`` what peers may take, ``fetch`` from one peer."""

    def __init__(self, node_id: int, host: str = "127.0.0.1", port: int = 0, *,
                 max_message_bytes: int = DEFAULT_MAX_BYTES, secret: bytes | None = None):
        super().__init__(node_id)
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes
        self.secret = secret
        self.address = ""
        self.requests_served = 0
        self.fetches = 0
        self.fetch_timeouts = 0
        self.requests_held = 0  # requests that asked to wait for a newer state
        self.held_fresh = 0  # held requests answered with a state published while they waited
        self.held_expired = 0  # ... and those answered with an older one when their wait ended
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._published: tuple[dict, dict] | None = None  # the latest state and its metadata
        self._version = 0  # publications so far
        self._last_publish = 0.0
        self._publish_interval = 0.0  # a moving average of the time between publications
        self._wake: tuple[socket.socket, socket.socket] | None = None  # publish -> serving thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._fetcher: ThreadPoolExecutor | None = None
        self._dealers: dict[int, zmq.Socket] = {}  # used by the fetch thread only
        self._request_id = 0

    def bind(self) -> str:
        tune_allocator()
        self._ctx = zmq.Context()
        try:
            router = bind_router(self._ctx, self.node_id, self.host, self.port, 64 * 1024)  # requests are tiny
        except Exception:
            self._ctx.term()
            self._ctx = None
            raise
        self._router = router
        self._wake = socket.socketpair()
        for end in self._wake:
            end.setblocking(False)
        self.address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    def connect(self, peers: Mapping[int, str]) -> None:
        """Remember the peers and start serving; no handshake (peers may be down and come back)."""
        if self._router is None:
            raise TransportError("bind() must be called before connect()")
        self.peers = dict(peers)
        if self._server is None:
            self._server = threading.Thread(target=self._serve, name=f"gossip-serve-{self.node_id}", daemon=True)
            self._server.start()
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix=f"gossip-fetch-{self.node_id}")

    def publish(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, float]) -> None:
        """Make this state what peers get from now on. The tensors must not change afterwards
        (pass a private copy): they may still be on their way to a peer."""
        state = (dict(tensors), dict(meta))
        with self._lock:
            self._published = state
            self._version += 1
            now = time.monotonic()
            if self._last_publish:
                since = now - self._last_publish
                self._publish_interval = 0.8 * self._publish_interval + 0.2 * since if self._publish_interval else since
            self._last_publish = now
            self._poke()  # held requests may now be answered

    def _poke(self) -> None:
        """Wake the serving thread (call with the lock held)."""
        if self._wake is not None:
            try:
                self._wake[1].send(b"!")
            except OSError:  # BlockingIOError: the serving thread already has wake-ups to read
                pass

    def fetch(self, peer: int, timeout: float, wait: float = 0.0) -> Future:
        """Start fetching ``peer``'s state; the future gives its Message, or None after ``timeout``
        seconds, on a refused or dead peer, or if it has published nothing yet. With ``wait`` > 0
        the peer answers with the newest state it publishes within ``wait`` seconds, if any, else
        with the one it has when the wait ends."""
        if self._fetcher is None:
            raise TransportError("connect() must be called before fetch()")
        return self._fetcher.submit(self._fetch, peer, timeout, wait)

    def extra_stats(self) -> dict[str, int]:
        return {"requests_served": self.requests_served, "fetches": self.fetches, "fetch_timeouts": self.fetch_timeouts,
                "requests_held": self.requests_held, "held_fresh": self.held_fresh, "held_expired": self.held_expired}

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._poke()
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True, cancel_futures=True)  # a fetch in flight ends at its timeout
            self._fetcher = None
        self._close_dealers()  # the fetch thread is gone: its sockets may be closed from here
        if self._server is not None:
            self._server.join(timeout=5.0)
            self._server = None
        if self._router is not None:
            self._router.close(linger=LINGER_MS)
            self._router = None
        with self._lock:  # a publish from another thread must not write to a closed socket
            wake, self._wake = self._wake, None
        for end in wake or ():
            end.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # --- the serving thread ----------------------------------------------------------------

    def _serve(self) -> None:
        router, wake = self._router, self._wake[0]
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        held: dict[int, _Held] = {}  # by peer
        closing_until: float | None = None
        while closing_until is None or time.monotonic() < closing_until:
            if closing_until is None and self._stop.is_set():
                # No newer state will come. Answer what is held, and for a moment answer at once
                # what still arrives: a request already on its way would cost its whole timeout,
                # and (measured on a loaded machine) a peer lost about one answer in four sent just
                # before the connection closed, linger or not.
                closing_until = time.monotonic() + CLOSE_GRACE
                self._answer_held(router, held, everything=True)
            deadlines = [h.deadline for h in held.values()] + ([closing_until] if closing_until else [])
            wait_ms = POLL_MS
            if deadlines:
                wait_ms = min(wait_ms, max(0, math.ceil((min(deadlines) - time.monotonic()) * 1000)))
            events = dict(poller.poll(wait_ms))
            if wake.fileno() in events:
                _drain(wake)
            if router in events:
                for _ in range(MAX_REQUESTS_PER_WAKE):  # then answer what is held, even under a flood
                    if not self._take_request(router, held):
                        break
            if held:
                self._answer_held(router, held, everything=closing_until is not None)

    def _take_request(self, router: zmq.Socket, held: dict[int, _Held]) -> bool:
        """Read one request, if any is waiting: answer it now, or hold it. False when none was."""
        try:
            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        try:
            request = decode(frames[1:], 64 * 1024, self.secret)
            wait = _requested_wait(request.meta)
        except WireError as exc:
            self.stats.malformed_dropped += 1
            log.debug("node %d: dropped a malformed request: %s", self.node_id, exc)
            return True
        if request.kind != Kind.REQUEST or request.sender not in self.peers:
            self.stats.unknown_sender_dropped += 1
            return True
        if wait > 0:
            with self._lock:
                version = self._version
            held[request.sender] = _Held(frames[0], request.iteration, version, time.monotonic() + wait)
            self.requests_held += 1
        else:
            self._reply(router, frames[0], request.iteration)
        return True

    def _answer_held(self, router: zmq.Socket, held: dict[int, _Held], everything: bool = False) -> None:
        with self._lock:
            version, next_publish = self._version, self._last_publish + self._publish_interval
        now = time.monotonic()
        # Answer a request when its wait is over, or when it can have a newer state and the next one
        # is not expected in time; otherwise keep it for that next one.
        for peer in [peer for peer, h in held.items()
                     if everything or h.deadline <= now or (h.version < version and next_publish >= h.deadline)]:
            request = held.pop(peer)
            if request.version < version:
                self.held_fresh += 1
            else:
                self.held_expired += 1
            self._reply(router, request.routing_id, request.request_id)

    def _reply(self, router: zmq.Socket, routing_id, request_id: int) -> None:
        with self._lock:
            published = self._published
        tensors, meta = published or ({}, {})
        # The request id travels in the iteration field; encoding only views the tensors.
        reply = encode(Message(Kind.REPLY, self.node_id, request_id, 0, tensors, meta), self.secret)
        router.send_multipart([routing_id, *reply], copy=False)
        self.requests_served += 1
        self.stats.messages_sent += 1
        self.stats.bytes_sent += sum(memoryview(f).nbytes for f in reply)

    # --- the fetch thread ------------------------------------------------------------------

    def _dealer(self, peer: int) -> zmq.Socket:
        dealer = self._dealers.get(peer)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.ROUTING_ID, _IDENTITY.pack(self.node_id))
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IMMEDIATE, 1)  # no live connection: sending is refused, not queued
            dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            dealer.connect(self.peers[peer])
            self._dealers[peer] = dealer
        return dealer

    def _fetch(self, peer: int, timeout: float, wait: float) -> Message | None:
        if self._stop.is_set() or peer not in self.peers:
            return None
        self.fetches += 1
        self._request_id += 1
        fresh = peer not in self._dealers
        dealer = self._dealer(peer)
        deadline = time.monotonic() + timeout
        try:
            # A new socket gets CONNECT_WAIT for its first handshake; a known peer whose connection
            # is down (gone, restarting) fails at once while ZeroMQ reconnects in the background.
            if not dealer.poll(int(min(timeout, CONNECT_WAIT) * 1000) if fresh else 0, zmq.POLLOUT):
                raise zmq.Again()  # no connection to the peer
            meta = {"wait": round(wait, 6)} if wait > 0 else {}
            request = encode(Message(Kind.REQUEST, self.node_id, self._request_id, meta=meta), self.secret)
            dealer.send_multipart(request, zmq.NOBLOCK)
            while (remaining := deadline - time.monotonic()) > 0:
                if not dealer.poll(max(1, int(remaining * 1000))):
                    continue
                frames = dealer.recv_multipart(copy=False)
                self.stats.bytes_received += sum(len(f) for f in frames)
                try:
                    reply = decode(frames, self.max_message_bytes, self.secret)
                except WireError as exc:
                    self.stats.malformed_dropped += 1
                    log.warning("node %d: dropped a malformed reply from %d: %s", self.node_id, peer, exc)
                    continue
                if reply.kind != Kind.REPLY or reply.sender != peer or reply.iteration != self._request_id:
                    self.stats.stale_dropped += 1
                    continue
                self.stats.messages_received += 1
                return reply if reply.tensors else None
        except zmq.ZMQError as exc:
            log.debug("node %d: fetch from %d failed: %s", self.node_id, peer, exc)
        self.fetch_timeouts += 1
        return None

    def _close_dealers(self) -> None:
        for dealer in self._dealers.values():
            dealer.close(linger=0)
        self._dealers.clear()


def _requested_wait(meta: dict) -> float:
    """How long a request asks to be held (0: answer now), at most ``MAX_HOLD``."""
    wait = meta_number(meta, "wait")
    if wait is None:
        raise WireError(f"a request's wait must be a non-negative number of seconds, not {meta['wait']!r}")
    return min(wait, MAX_HOLD)


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except OSError:  # BlockingIOError: nothing more to read
        pass
