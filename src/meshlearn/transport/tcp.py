"""TCP transport over ZeroMQ: one ROUTER socket to receive, one DEALER per neighbour to send.

A sealed message (a network task's) that does not open on the way, damaged, is refused at once:
the receiver answers over the connection it came by (bound to a neighbour by the handshake) with
a refusal (``transport.served.refusal``) naming the seal counter its header claims, and the
sender sends that message again from the frames it keeps of its last ``KEEP_SENT`` models, at
most ``MAX_RESENDS`` times to each neighbour, or answers that it will not (a *decline*: a REPLY
saying so). A damaged model thus costs one round trip, not the receiver's whole wait. The copy
sent again carries the same seal counter: the damaged one never opened, so the receiver's replay
window takes it, once. Until the answer comes the receiver waits for that neighbour even if it
said goodbye meanwhile (it refuses a model of its last round and leaves). A refusal is sealed
like any message, so none can be forged, and one played again is refused as a replay; a message
whose header is too damaged to name it is not refused, and costs the wait as before.

A link punched through NATs is connected from both ends (``meet``: the ROUTER connects out to
the neighbour's DEALER, TCP's simultaneous open joining the two), and its DEALER falls back to
another address should that path carry no handshake in time (``fall_back``).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import zmq

from meshlearn.errors import TransportError, WireError
from meshlearn.netem import DelayLine, Emulator, LinkRate, NetemSpec
from meshlearn.sparselog import SparseLog
from meshlearn.transport.allocator import tune_allocator
from meshlearn.transport.base import Receipt, Transport
from meshlearn.transport.served import is_refusal, refusal
from meshlearn.transport.settings import TcpSettings
from meshlearn.transport.zmqsock import bind_router
from meshlearn.wire import Kind, Message
from meshlearn.wire.sealed import (
    FrameSeal,
    ReplayedMessage,
    claimed_stamp,
    decode_for,
    encode_for,
)

log = logging.getLogger(__name__)
_IDENTITY = struct.Struct("<I")
# Whole messages ZeroMQ holds per connection before it stops reading that socket (the sender then
# waits, or drops and counts): a neighbour is at most a few iterations ahead, a stranger gets no more.
RECEIVE_QUEUE = 16
# Sealed models whose frames a sender keeps to send again: this round's, and the one before (a
# neighbour still gathering the round before may refuse that one after this node sent the next).
KEEP_SENT = 2
# Times one kept model is sent again to one neighbour that refuses it: a path that damages every
# copy costs the receiver its wait, as before, and cannot have it sent without end. High enough that
# chance does not reach it: with every second model damaged on the way (each copy sent again is
# damaged again about half the time) a copy needed six goes in about 1,400 (benchmarks/RESULTS.md).
MAX_RESENDS = 16
REFUSAL_BYTES = 64 * 1024  # the most a refusal may take (it carries a reason only): a sender reads no more
AWAITED = 2 * KEEP_SENT  # refusals a receiver awaits the answer to, per neighbour (the oldest forgotten)
DECLINED = "declined"  # a sender's answer to a refusal of a model it will not send again
WATCH_EVERY = 0.05  # seconds between looks at the punched paths not yet known to work, while connecting
MEET_RECONNECT_MAX_MS = 2000  # both ends of a punched link that broke connect again from 100 ms to this


@dataclass
class _Watch:
    """A DEALER connecting over a punched path: ``monitor`` says when ZeroMQ's handshake is done;
    at ``deadline``, if it is not, the DEALER dials ``fallback`` instead of ``primary``."""

    monitor: zmq.Socket
    deadline: float
    primary: str
    fallback: str


@dataclass
class _Kept:
    """A sealed model sent, kept to be sent again: its frames, and the times each neighbour it
    went to has had it again."""

    frames: list
    resends: dict[int, int]


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
        self._meets: dict[int, str] = {}  # neighbour -> where the ROUTER connects to meet its link (``meet``)
        self._fallbacks: dict[int, tuple[str, float]] = {}  # neighbour -> (address, seconds) (``fall_back``)
        self._watching: dict[int, _Watch] = {}  # DEALERs over punched paths, until their handshake is done
        self._routes: dict[bytes, int] = {}  # connection (ZeroMQ routing id) -> the neighbour it said HELLO as
        self._poller = zmq.Poller()
        self._closed = False
        self._joining: list[tuple[int, str]] = []  # neighbours that joined, for the next send or receive to take in
        self._joining_lock = threading.Lock()
        self._kept: dict[int, _Kept] = {}  # seal counter -> a sealed model sent, oldest first (KEEP_SENT)
        self.refusals_sent = 0  # sealed messages from neighbours that did not open, refused back at once
        self.resent = 0  # models sent again because a neighbour refused them (damaged on the way)
        self.resends_declined = 0  # refusals naming a model not kept, or sent again MAX_RESENDS times already
        self._declines = SparseLog(log)
        self._awaited: dict[int, list[int]] = {}  # neighbour -> counters it was refused, not answered yet

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
        if self._meets:
            self._router.setsockopt(zmq.RECONNECT_IVL_MAX, MEET_RECONNECT_MAX_MS)
        for address in self._meets.values():
            self._router.connect(address)
        for peer, address in self.peers.items():
            self._dial(peer, address)
        greeted: set[int] = set()
        deadline = time.monotonic() + self.handshake_timeout
        while self.peers.keys() - greeted - self.departed or self._watching:  # and each punched path known
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(self.peers.keys() - greeted - self.departed)
                where = ", ".join(f"{p} at {self.peers[p]}" for p in missing)
                raise TransportError(
                    f"node {self.node_id}: neighbour(s) {where} did not answer the handshake "
                    f"within {self.handshake_timeout:g} s"
                )
            msg = self.recv(min(remaining, WATCH_EVERY) if self._watching else remaining)
            if msg is None:
                continue
            if msg.kind == Kind.HELLO:
                greeted.add(msg.sender)
            elif msg.kind == Kind.MODEL:
                self._keep(msg)

    meets = True  # one DEALER per neighbour (served endpoints connect once per calling thread: they cannot)

    def meet(self, peer: int, address: str) -> None:
        """Have the ROUTER connect to ``address`` as well, to meet ``peer``'s link to this node where
        both ends connect at once: a path punched through NATs, ``tcp://SOURCE;TARGET`` from this
        node's punching port to the port the neighbour's DEALER connects from (TCP's simultaneous
        open makes the two connects one connection). Before ``connect``."""
        if not address.startswith("tcp://") or ";" not in address:
            raise TransportError(f"node {self.node_id}: cannot meet neighbour {peer} at {address!r}: "
                                 "expected tcp://SOURCE:PORT;TARGET:PORT")
        self._meets[peer] = address

    def fall_back(self, peer: int, address: str, after: float) -> None:
        """Have the DEALER to ``peer`` dial ``address`` instead should its connection not have
        carried ZeroMQ's handshake ``after`` seconds into ``connect`` (a punched path the NATs let
        the punch through but not the engine's connect: ``address`` carries the link another way).
        Before ``connect``."""
        self._fallbacks[peer] = (address, after)

    def _check_fallbacks(self) -> None:
        """Forget the watches whose handshake is done; dial the fallback of those past their deadline."""
        for peer, watch in list(self._watching.items()):
            shook = bool(watch.monitor.poll(0))  # its one event: the handshake is done
            if not shook and time.monotonic() < watch.deadline:
                continue
            dealer = self._dealers[peer]
            if not shook:  # the punched path did not carry it: the fallback, and HELLO again
                log.info("node %d: the punched path to %d carried no handshake: dialing %s", self.node_id, peer,
                         watch.fallback)
                dealer.disconnect(watch.primary)
                dealer.connect(watch.fallback)
                self._send_frames(peer, encode_for(Message(Kind.HELLO, self.node_id), self.secret, self.seal))
            del self._watching[peer]
            dealer.disable_monitor()
            watch.monitor.close(linger=0)

    def _dial(self, peer: int, address: str) -> None:
        """Connect to ``peer`` at ``address`` and say HELLO (the handshake's half this side sends)."""
        dealer = self._ctx.socket(zmq.DEALER)
        # A random routing id: a stranger cannot take over (or squat) a neighbour's connection
        # by claiming its id, since the id says nothing about who sends (see _accept).
        dealer.setsockopt(zmq.ROUTING_ID, _IDENTITY.pack(self.node_id) + os.urandom(8))
        dealer.setsockopt(zmq.LINGER, int(self.linger * 1000))
        dealer.setsockopt(zmq.SNDHWM, 64)
        dealer.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)  # what comes back is refusals: few, and small
        dealer.setsockopt(zmq.MAXMSGSIZE, REFUSAL_BYTES)
        fallback = self._fallbacks.pop(peer, None)
        if fallback is not None:  # a punched path: watched from before the connect, so its handshake is never missed
            dealer.setsockopt(zmq.RECONNECT_IVL_MAX, MEET_RECONNECT_MAX_MS)
            self._watching[peer] = _Watch(dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED),
                                          time.monotonic() + fallback[1], address, fallback[0])
        dealer.connect(address)
        self._dealers[peer] = dealer
        self._poller.register(dealer, zmq.POLLIN)  # refusals of what this node sent
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
            if peer not in self._dealers and self._ctx is not None and self.take_in(peer, address):
                self._dial(peer, address)

    def send(self, peer: int, msg: Message) -> None:
        self.broadcast([peer], msg)

    def broadcast(self, peers: Iterable[int], msg: Message) -> Receipt:
        """Send one message to several neighbours, encoding it (and viewing its tensors) once."""
        self._take_in_joined()
        if self._watching:
            self._check_fallbacks()
        self._take_refusals()  # a model of the round before, refused, goes again before this one
        frames = encode_for(msg, self.secret, self.seal)
        peers = list(peers)
        trackers: list[zmq.MessageTracker] = []
        for peer in peers:
            trackers += self._send_frames(peer, frames)
        self._keep_sent(msg, frames, peers)
        return _Trackers(trackers)

    def _keep_sent(self, msg: Message, frames: list, peers: list[int]) -> None:
        """Keep a sealed model's frames (a copy of its own: sealing wrote them) to send again to a
        neighbour that refuses it; the newest ``KEEP_SENT`` only."""
        stamp = claimed_stamp(frames[0]) if self.seal is not None and msg.kind == Kind.MODEL else None
        if stamp is None:
            return
        self._kept[stamp.counter] = _Kept(frames, dict.fromkeys(peers, 0))
        while len(self._kept) > KEEP_SENT:
            del self._kept[next(iter(self._kept))]

    def _take_refusals(self) -> None:
        """Read what the neighbours sent back over this node's connections to them (refusals), and
        send again each model they refused."""
        for peer, dealer in list(self._dealers.items()):
            while True:
                try:
                    frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_refusal(peer, frames)

    def _on_refusal(self, peer: int, frames: list) -> None:
        """Send again the kept model ``peer``'s refusal names, if it still may be (``MAX_RESENDS``)."""
        self.stats.bytes_received += sum(len(f) for f in frames)
        try:
            answer = decode_for(frames, REFUSAL_BYTES, self.secret, self.seal, self.window)
        except WireError as exc:  # damaged, forged, or a refusal played again: it sends nothing again
            self.drop_refused(exc, f"an answer from {peer}")
            return
        if answer.kind != Kind.REPLY or answer.sender != peer or not is_refusal(answer):
            self.stats.unknown_sender_dropped += 1
            return
        kept = self._kept.get(answer.iteration)
        if kept is None or kept.resends.get(peer, MAX_RESENDS) >= MAX_RESENDS:
            self.resends_declined += 1
            self._declines.warning("declined", "node %d: %d refused message %d, which is not kept or was sent again "
                                   "%d times already: it is not sent again", self.node_id, peer, answer.iteration,
                                   MAX_RESENDS)
            decline = Message(Kind.REPLY, self.node_id, answer.iteration, 0, {}, {"status": DECLINED})
            self._send_frames(peer, encode_for(decline, self.secret, self.seal))  # so it waits for it no more
            return
        kept.resends[peer] += 1
        dropped = self.stats.send_dropped
        self._send_frames(peer, kept.frames)
        self.resent += self.stats.send_dropped == dropped

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
            if self._watching:  # punched paths not yet known to work: looked at by their deadlines
                self._check_fallbacks()
                remaining = min([remaining, *(w.deadline - time.monotonic() + 0.01 for w in self._watching.values())])
            if self._held:
                remaining = min(remaining, self._held.next_due() - self.clock())
            ready = dict(self._poller.poll(max(0, int(remaining * 1000))))
            if not ready:
                if time.monotonic() >= deadline and not (self._held and self._held.next_due() <= self.clock()):
                    return None
                continue
            if len(ready) > (self._router in ready):  # a neighbour refused something this node sent
                self._take_refusals()
            if self._router not in ready:
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
        route = frames[0].bytes
        try:
            msg = decode_for(frames[1:], self.max_message_bytes, self.secret, self.seal, self.window)
        except WireError as exc:
            self.drop_refused(exc, "a message")
            if not isinstance(exc, ReplayedMessage):  # a copy played again has had its answer: its original
                self._refuse(route, frames[1:2], exc)
            return None
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
        if self._awaited.get(msg.sender):  # a model sent again, or a decline (delivered: a gather looks again), answers
            declined = msg.kind == Kind.REPLY and msg.meta.get("status") == DECLINED
            self._answered(msg.sender, msg.iteration if declined else claimed_stamp(frames[1]).counter)
        return msg

    def _answered(self, peer: int, counter: int) -> None:
        """The refusal of ``peer``'s message ``counter`` is answered (sent again, or declined)."""
        awaited = self._awaited.get(peer, [])
        if counter in awaited:
            awaited.remove(counter)

    def finished(self) -> set[int]:
        """Those that said goodbye, less those this node refused a message of and awaits the answer from."""
        return {peer for peer in self.departed if not self._awaited.get(peer)}

    def _refuse(self, route: bytes, header: list, error: WireError) -> None:
        """Tell the neighbour a sealed message came from (by the connection it came over, which its
        HELLO bound) that it did not open, naming the counter its ``header`` claims, so it is sent
        again at once. A stranger is told nothing, nor is anyone where no counter can be read."""
        peer = self._routes.get(route)
        stamp = claimed_stamp(header[0]) if self.seal is not None and header else None
        if stamp is None or peer not in self.peers:
            return
        answer = encode_for(refusal(self.node_id, stamp.counter, str(error)), self.secret, self.seal)
        try:
            self._router.send_multipart([route, *answer], zmq.NOBLOCK)
        except zmq.ZMQError:  # its connection is gone or full: the message costs the wait
            return
        self.refusals_sent += 1
        awaited = self._awaited.setdefault(peer, [])
        if stamp.counter not in awaited:
            awaited.append(stamp.counter)
            del awaited[:-AWAITED]

    def extra_stats(self) -> dict[str, int]:
        """Refusals of damaged messages, both ways: those sent, the models sent again, those declined."""
        return {"refusals_sent": self.refusals_sent, "resent": self.resent, "resends_declined": self.resends_declined}

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
            for watch in self._watching.values():
                watch.monitor.close(linger=0)
            heard = set(self._routes.values())
            for peer, dealer in self._dealers.items():
                dealer.close(linger=None if peer in heard else 0)  # what is queued for one never there goes nowhere
            if self._router is not None:
                self._router.close()
            self._ctx.term()
