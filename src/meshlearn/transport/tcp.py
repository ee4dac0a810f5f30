"""TCP transport over ZeroMQ: one ROUTER socket to receive, one DEALER per neighbour to send."""

from __future__ import annotations

import os
import struct
import threading
import time
from typing import Callable, Iterable, Mapping

import zmq

from meshlearn.errors import TransportError, WireError
from meshlearn.netem import DelayLine, Emulator, LinkRate, NetemSpec
from meshlearn.transport.allocator import tune_allocator
from meshlearn.transport.base import Receipt, Transport
from meshlearn.transport.settings import TcpSettings
from meshlearn.transport.zmqsock import bind_router
from meshlearn.wire import Kind, Message
from meshlearn.wire.sealed import FrameSeal, decode_for, encode_for

_IDENTITY = struct.Struct("<I")
# Whole messages ZeroMQ holds per connection before it stops reading that socket (the sender then
# waits, or drops and counts): a neighbour is at most a few iterations ahead, a stranger gets no more.
RECEIVE_QUEUE = 16


class _Trackers(Receipt):
    """Done when ZeroMQ has released every zero-copy frame of the sends it tracks."""

    def __init__(self, trackers: list[zmq.MessageTracker]):
        self.trackers = trackers

    @property
    def done(self) -> bool:
        return all(tracker.done for tracker in self.trackers)


class TcpTransport(Transport):
    """Reliable, ordered messages between neighbours over ZeroMQ TCP.

    Each transport owns a ZeroMQ context, so ``close()`` can flush what is still queued
    (bounded by ``linger``) without touching other nodes hosted in the same process.
    """

    def __init__(self, node_id: int, host: str = "127.0.0.1", port: int = 0, *, settings: TcpSettings | None = None,
                 netem: NetemSpec | None = None, seed: int = 0, secret: bytes | None = None,
                 clock: Callable[[], float] = time.monotonic, seal: FrameSeal | None = None):
        super().__init__(node_id)
        self.seal = seal  # network tasks: every message encrypted with the task's key
        self.settings = settings = settings or TcpSettings()
        self.secret = secret
        self.emulator = Emulator(netem or NetemSpec(), seed * 7919 + node_id)
        self.clock = clock  # when emulated delays fall due (tests may drive it)
        self._held = DelayLine(keep_order=True)  # messages under emulated delay: TCP never reorders
        self.link_rate = LinkRate(self.emulator.spec.rate) if self.emulator.spec.rate else None
        self.host, self.port = host, port
        self.max_message_bytes = settings.max_message_bytes
        self.handshake_timeout = settings.handshake_timeout
        self.bye_timeout = settings.wait_timeout
        self.linger = settings.linger
        self.address = ""
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._dealers: dict[int, zmq.Socket] = {}
        self._routes: dict[bytes, int] = {}  # connection (ZeroMQ routing id) -> the neighbour it said HELLO as
        self._poller = zmq.Poller()
        self._closed = False
        self._joining: list[tuple[int, str]] = []  # neighbours that joined, for the next send or receive to take in
        self._joining_lock = threading.Lock()

    def bind(self) -> str:
        tune_allocator()
        self._ctx = zmq.Context()
        try:
            router = bind_router(self._ctx, self.node_id, self.host, self.port, self.max_message_bytes,
                                 {zmq.RCVHWM: RECEIVE_QUEUE})
        except Exception:
            self._ctx.term()
            self._ctx = None
            raise
        self._router = router
        self._poller.register(router, zmq.POLLIN)
        self.address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    @property
    def gather_timeout(self) -> float:
        return self.settings.wait_timeout

    def connect(self, peers: Mapping[int, str]) -> None:
        if self._router is None:
            raise TransportError("bind() must be called before connect()")
        self.peers = dict(peers)
        for peer, address in self.peers.items():
            self._dial(peer, address)
        greeted: set[int] = set()
        deadline = time.monotonic() + self.handshake_timeout
        while self.peers.keys() - greeted - self.departed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(self.peers.keys() - greeted - self.departed)
                where = ", ".join(f"{p} at {self.peers[p]}" for p in missing)
                raise TransportError(
                    f"node {self.node_id}: neighbour(s) {where} did not answer the handshake "
                    f"within {self.handshake_timeout:g} s"
                )
            msg = self.recv(remaining)
            if msg is None:
                continue
            if msg.kind == Kind.HELLO:
                greeted.add(msg.sender)
            elif msg.kind == Kind.MODEL:
                self._keep(msg)

    def _dial(self, peer: int, address: str) -> None:
        """Connect to ``peer`` at ``address`` and say HELLO (the handshake's half this side sends)."""
        dealer = self._ctx.socket(zmq.DEALER)
        # A random routing id: a stranger cannot take over (or squat) a neighbour's connection
        # by claiming its id, since the id says nothing about who sends (see _accept).
        dealer.setsockopt(zmq.ROUTING_ID, _IDENTITY.pack(self.node_id) + os.urandom(8))
        dealer.setsockopt(zmq.LINGER, int(self.linger * 1000))
        dealer.setsockopt(zmq.SNDHWM, 64)
        dealer.connect(address)
        self._dealers[peer] = dealer
        self._send_frames(peer, encode_for(Message(Kind.HELLO, self.node_id), self.secret, self.seal))

    def add_peer(self, peer: int, address: str) -> None:
        with self._joining_lock:
            self._joining.append((peer, address))

    def _take_in_joined(self) -> None:
        """Dial the neighbours that joined since the last send or receive (on the thread that sends
        and receives: ZeroMQ sockets are not shared between threads), before anything they sent
        is read."""
        with self._joining_lock:
            joined, self._joining = self._joining, []
        for peer, address in joined:
            if peer not in self._dealers and self._ctx is not None:
                self.peers = {**self.peers, peer: address}
                self._dial(peer, address)

    def send(self, peer: int, msg: Message) -> None:
        self._take_in_joined()
        self._send_frames(peer, encode_for(msg, self.secret, self.seal))

    def broadcast(self, peers: Iterable[int], msg: Message) -> Receipt:
        """Send one message to several neighbours, encoding it (and viewing its tensors) once."""
        self._take_in_joined()
        frames = encode_for(msg, self.secret, self.seal)
        trackers: list[zmq.MessageTracker] = []
        for peer in peers:
            trackers += self._send_frames(peer, frames)
        return _Trackers(trackers)

    def _send_frames(self, peer: int, frames: list) -> list[zmq.MessageTracker]:
        """Send one multipart message; frames of 64 KiB and more go zero-copy and are tracked."""
        if peer not in self.peers and peer in self.departed:  # shut out of the run (``exclude``): it gets nothing
            return []
        dealer = self._dealers.get(peer)
        if dealer is None:
            raise TransportError(f"node {self.node_id}: {peer} is not a neighbour")
        trackers = []
        last = len(frames) - 1
        try:
            for index, frame in enumerate(frames):
                flags = (zmq.SNDMORE if index < last else 0) | (zmq.NOBLOCK if index == 0 else 0)
                if memoryview(frame).nbytes >= zmq.COPY_THRESHOLD:
                    trackers.append(dealer.send(frame, flags, copy=False, track=True))
                else:
                    dealer.send(frame, flags)
        except zmq.Again:  # only the first part can be refused; a multipart message is atomic
            self.stats.send_dropped += 1
            return []
        self.stats.messages_sent += 1
        self.stats.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        return trackers

    def recv(self, timeout: float) -> Message | None:
        if self._joining:
            self._take_in_joined()
        deadline = time.monotonic() + timeout
        while True:
            due = self._held.pop_next(self.clock())
            if due is not None:
                return self._deliver(due)
            remaining = deadline - time.monotonic()
            if self._held:
                remaining = min(remaining, self._held.next_due() - self.clock())
            if not self._poller.poll(max(0, int(remaining * 1000))):
                if time.monotonic() >= deadline and not (self._held and self._held.next_due() <= self.clock()):
                    return None
                continue
            frames = self._router.recv_multipart(copy=False)
            msg = self._accept(frames)
            if msg is None:
                continue
            now = self.clock()
            through = now if self.link_rate is None else self.link_rate.through(
                msg.sender, sum(len(frame) for frame in frames[1:]), now)  # its link's emulated bandwidth
            due = through + self.emulator.delay() + self.emulator.retransmit_delay(
                sum(t.numel() * t.element_size() for t in msg.tensors.values()))
            if due <= now and not self._held:
                return self._deliver(msg)
            self._held.push(msg, due, key=msg.sender)  # emulated time on the link, in order on each

    def _deliver(self, msg: Message) -> Message:
        if msg.kind == Kind.BYE:
            self.departed.add(msg.sender)
        return msg

    def _accept(self, frames: list) -> Message | None:
        """Decode one received multipart message; count and drop anything invalid."""
        self.stats.bytes_received += sum(len(f) for f in frames)
        try:
            msg = decode_for(frames[1:], self.max_message_bytes, self.secret, self.seal, self.window)
        except WireError as exc:
            self.drop_refused(exc, "a message")
            return None
        route = frames[0].bytes
        if msg.kind == Kind.HELLO and msg.sender not in self.peers and self._joining:
            self._take_in_joined()  # a neighbour that joined while this thread waited in recv
        if msg.kind == Kind.HELLO and msg.sender in self.peers:
            # The handshake binds a connection to the neighbour it names (signed, with a secret);
            # every later message must come over a connection bound to its sender.
            self._routes.setdefault(route, msg.sender)
        if self._routes.get(route) != msg.sender or msg.sender not in self.peers:  # unbound, or shut out
            self.stats.unknown_sender_dropped += 1
            return None
        self.stats.messages_received += 1
        return msg

    def close(self) -> None:
        if self._closed or self._ctx is None:
            return
        self._closed = True
        try:
            if self._dealers:
                bye = encode_for(Message(Kind.BYE, self.node_id), self.secret, self.seal)
                for peer in self._dealers:
                    self._send_frames(peer, bye)
                # A neighbour's BYE means it no longer needs anything from us, so our queued
                # messages were consumed; wait for them (bounded) before dropping the sockets.
                # One that never said HELLO (it never came) will not say BYE either.
                deadline = time.monotonic() + self.bye_timeout
                while set(self._routes.values()) & self.peers.keys() - self.departed and time.monotonic() < deadline:
                    self.recv(deadline - time.monotonic())
        finally:
            heard = set(self._routes.values())
            for peer, dealer in self._dealers.items():
                dealer.close(linger=None if peer in heard else 0)  # what is queued for one never there goes nowhere
            if self._router is not None:
                self._router.close()
            self._ctx.term()
