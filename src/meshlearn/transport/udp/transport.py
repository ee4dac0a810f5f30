"""The UDP transport: a socket, a HELLO handshake, and two thin threads around the pure cores.

The receive thread drains the socket all the time into the ``Reassembler`` (so datagrams do not
pile up in the kernel while the node trains: the cause of the self-inflicted loss measured in
the UDP study), reading each datagram's payload straight into the slot of the chunk that most
likely comes next (the one after the last received; a wrong guess lands in a slot not yet
filled and is moved, so the kernel's copy is the only one). The delay thread, started only under
emulated delay, releases the ``DatagramSender``'s delayed datagrams when they fall due.
"""

from __future__ import annotations

import dataclasses
import logging
import select
import socket
import threading
import time
from collections import deque
from typing import Iterable, Mapping

from meshlearn.errors import TransportError, WireError
from meshlearn.layout import TensorLayout
from meshlearn.netem import Emulator, NetemSpec
from meshlearn.transport.base import DONE, Receipt, Transport
from meshlearn.transport.settings import UdpSettings, default_chunk_bytes
from meshlearn.transport.udp.handshake import Handshake
from meshlearn.transport.udp.reassembly import Reassembler
from meshlearn.transport.udp.sender import DatagramSender
from meshlearn.transport.udp.sockets import DatagramReader, open_socket
from meshlearn.wire import Kind, Message
from meshlearn.wire.datagram import (
    HEADER_SIZE,
    MAX_DATAGRAM,
    ChunkHeader,
    check_payload,
    parse_header,
)
from meshlearn.wire.sealed_datagram import OVERHEAD, DatagramSeal, DatagramWindow

log = logging.getLogger(__name__)
HELLO_EVERY = 0.1
POLL_MS = 100
SEALED_SHRINK = 32  # OVERHEAD rounded up to a multiple of 8 (chunk sizes are)
MAX_CONTROL = 64  # control messages kept for recv() (REQUEST, REPLY over UDP): no algorithm reads them today


class UdpTransport(Transport):
    """Sends each message as checksummed datagrams; tolerates their loss (see ``transport.udp``)."""

    lossy = True

    def __init__(self, node_id: int, host: str = "127.0.0.1", port: int = 0, *, layout: TensorLayout,
                 settings: UdpSettings | None = None, netem: NetemSpec | None = None, seed: int = 0,
                 seal: DatagramSeal | None = None):
        super().__init__(node_id)
        self.settings = settings = settings or UdpSettings()
        self.host, self.port = host, port
        self.layout = layout
        self.seal = seal  # network tasks: every datagram sealed with the task's key, and taken once
        self.window = DatagramWindow() if seal is not None else None
        # a sealed datagram carries OVERHEAD more bytes: its default chunk shrinks so it still fits the path
        self.chunk_bytes = settings.chunk_bytes or default_chunk_bytes(host) - (SEALED_SHRINK if seal else 0)
        if seal is not None and HEADER_SIZE + self.chunk_bytes + OVERHEAD > MAX_DATAGRAM:
            raise TransportError(f"chunk_bytes {self.chunk_bytes} leaves no room for the seal: at most "
                                 f"{MAX_DATAGRAM - HEADER_SIZE - OVERHEAD} for sealed datagrams")
        self.mode = settings.mode
        self.max_message_bytes = settings.max_message_bytes
        netem = netem or NetemSpec()
        self.sender = DatagramSender(node_id, self._sendmsg, self.chunk_bytes, settings.rate_gbps * 1e9 / 8,
                                     Emulator(netem, seed * 7919 + node_id),
                                     Emulator(netem, seed * 7919 + node_id + 104_729), self.stats, seal=seal)
        self.reassembler = Reassembler(layout, self.chunk_bytes, self.stats,
                                       late=settings.late_chunks == "use" and settings.mode == "sync")
        self.address = ""
        self.datagrams_received = 0
        self.rcvbuf_drops = 0
        self._sock: socket.socket | None = None
        self._addrs: dict[int, tuple[str, int]] = {}
        self._cond = threading.Condition()  # guards the reassembler and the handshake and control state
        self._control: deque[Message] = deque()
        self.handshake = Handshake()
        self._stop = threading.Event()
        self._closed = False
        # While a slot is armed for the receive thread (see the module docstring) its message must
        # stay in the reassembler; gather sets _taking and waits for the receive thread to disarm.
        self._armed: tuple[object, int, memoryview] | None = None
        self._taking = False

    @property
    def gather_timeout(self) -> float:
        return self.settings.timeout

    @property
    def emulator(self) -> Emulator:
        return self.sender.emulator

    # --- set-up ---------------------------------------------------------------------------

    @property
    def datagram_socket(self):
        """The bound socket (``bind``), before the transport reads it: a network task's engine behind
        NAT asks through it where its NAT maps it (peers then send to that address)."""
        return self._sock

    def bind(self) -> str:
        # non-blocking: the receive thread polls (see _receive_loop)
        self._sock = open_socket(self.host, self.port, int(self.settings.rcvbuf_mb * 1024 * 1024), self.node_id)
        host, port = self._sock.getsockname()
        self.address = f"udp://{host}:{port}"
        return self.address

    def connect(self, peers: Mapping[int, str]) -> None:
        if self._sock is None:
            raise TransportError("bind() must be called before connect()")
        self.peers = dict(peers)
        for peer, address in self.peers.items():
            host, _, port = address.removeprefix("udp://").rpartition(":")
            self._addrs[peer] = (host, int(port))
        self.start_thread(self._receive_loop, "udp-recv")
        if self.sender.emulator.spec.delay or self.sender.emulator.spec.jitter or self.sender.emulator.spec.rate:
            self.start_thread(self._delay_loop, "udp-delay")
        deadline = time.monotonic() + self.settings.handshake_timeout
        while True:
            with self._cond:
                waiting = self.handshake.waiting(self.peers, self.departed)
                if not waiting:
                    return
                flags = {peer: self.handshake.hello_flags(peer) for peer in waiting}
            if time.monotonic() > deadline:
                where = ", ".join(f"{p} at {self.peers[p]}" for p in sorted(waiting))
                raise TransportError(f"node {self.node_id}: neighbour(s) {where} did not answer the handshake "
                                     f"within {self.settings.handshake_timeout:g} s")
            for peer, flag in flags.items():
                self.sender.send_control(Kind.HELLO, self._addrs[peer], flag)
            with self._cond:
                self._cond.wait(HELLO_EVERY)

    # --- sending --------------------------------------------------------------------------

    def _sendmsg(self, pieces: list, addr: tuple[str, int]) -> None:
        self._sock.sendmsg(pieces, [], 0, addr)

    def send(self, peer: int, msg: Message) -> None:
        self.broadcast([peer], msg)

    def broadcast(self, peers: Iterable[int], msg: Message) -> Receipt:
        """Send a message to each peer as datagrams; returns once they are handed to the kernel
        (or copied into the delay line), so the tensors may be reused at once. Its tensors must be
        the layout's (in any order: they travel in the layout's)."""
        if msg.tensors:
            try:
                msg = dataclasses.replace(msg, tensors=self.layout.ordered(msg.tensors))
            except WireError as exc:
                raise TransportError(f"node {self.node_id}: the message does not fit the UDP layout: {exc}") from None
        self.sender.send_model(msg, [self._addrs[peer] for peer in peers], self.layout.nbytes if msg.tensors else 0)
        return DONE

    def _delay_loop(self) -> None:
        while not self._stop.is_set():
            self.sender.release_due(wait=POLL_MS / 1000)

    # --- receiving ------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        reader = DatagramReader(self._sock)
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        plain = memoryview(bytearray(MAX_DATAGRAM))  # a sealed datagram's payload, opened
        while not self._stop.is_set():
            armed = self._armed
            try:
                size, payload, filled = reader.read(armed[2] if armed else None)
            except BlockingIOError:
                if armed is not None:
                    self._disarm()
                poller.poll(POLL_MS)
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            self.rcvbuf_drops = reader.rcvbuf_drops
            self.stats.bytes_received += size
            try:
                if size < HEADER_SIZE:
                    raise WireError(f"datagram of {size} bytes is shorter than the {HEADER_SIZE}-byte header")
                header, checksum = parse_header(reader.head, self.max_message_bytes)
                try:
                    if self.seal is not None:
                        payload = self._open(reader.head, header, payload, plain)
                        if payload is None:
                            continue
                    check_payload(reader.head, header, checksum, payload)
                except WireError:
                    self._refuse(header)  # damaged on the way: UDP sends nothing again, so it is not waited for
                    raise
                in_place = filled and armed[0].header.sender == header.sender and \
                    armed[0].header.iteration == header.iteration and armed[1] == header.index
                self._accept(header, payload, in_place)
            except WireError as exc:
                self.stats.malformed_dropped += 1
                log.debug("node %d: dropped a malformed datagram: %s", self.node_id, exc)
            except Exception:  # noqa: BLE001 - one datagram must not end reception
                self.stats.malformed_dropped += 1
                log.exception("node %d: a datagram could not be handled", self.node_id)

    def _open(self, head: memoryview, header: ChunkHeader, body: memoryview, plain: memoryview) -> memoryview | None:
        """A sealed datagram's payload, opened into ``plain``; None (counted) for one taken before.
        WireError where it does not open."""
        out = plain[:header.payload_size()]
        prefix, counter = self.seal.open(head, body, out)
        problem = self.window.admit(header.sender, prefix, counter)
        if problem is not None:
            self.stats.add(replay_dropped=1)
            log.debug("node %d: dropped a replayed datagram: %s", self.node_id, problem)
            return None
        return out

    def _refuse(self, header: ChunkHeader) -> None:
        """A neighbour's model chunk that came damaged: a sync gather waits for it no more."""
        if header.sender not in self.peers:
            return
        with self._cond:
            if self.reassembler.refuse(header):
                self._cond.notify_all()

    def _disarm(self) -> None:
        with self._cond:
            self._armed = None
            if self._taking:
                self._cond.notify_all()

    def _accept(self, header: ChunkHeader, payload: memoryview, in_place: bool = False) -> None:
        if header.sender not in self.peers:
            self.stats.unknown_sender_dropped += 1
            self._disarm()
            return
        self.datagrams_received += 1
        with self._cond:
            self._armed = None
            if header.kind == Kind.MODEL:
                complete, following = self.reassembler.add(header, payload, in_place)
                if complete:
                    self.stats.messages_received += 1
                elif not self._taking and self.seal is None:  # sealed: opened into a buffer of its own
                    self._armed = following
                settled = complete or (bool(self.reassembler.refused) and
                                       self.reassembler.settled(header.sender, header.iteration))
                if settled or self._taking:  # wake a waiting gather only when a model is complete (or settled)
                    self._cond.notify_all()
                return
            if header.kind == Kind.HELLO:
                answer = self.handshake.on_hello(header.sender, header.flags)
                if answer is not None:  # a peer still sending HELLO wants to know we heard it
                    self.sender.send_control(Kind.HELLO, self._addrs[header.sender], answer)
            elif header.kind == Kind.BYE:
                self.departed.add(header.sender)
            elif len(self._control) < MAX_CONTROL:
                self._control.append(Message(header.kind, header.sender, header.iteration, header.degree))
            else:  # nobody reads control messages of other kinds: a peer must not fill memory with them
                self.stats.overflow_dropped += 1
            self._cond.notify_all()

    def recv(self, timeout: float) -> Message | None:
        """The next control message (not HELLO, BYE or MODEL: those are handled by the transport)."""
        with self._cond:
            if not self._control:
                self._cond.wait(timeout)
            return self._control.popleft() if self._control else None

    def gather(self, iteration: int, peers: Iterable[int], timeout: float | None = None) -> dict[int, Message]:
        """``sync``: wait until every neighbour's model of ``iteration`` is complete, or the
        timeout; ``async``: take each neighbour's newest model at once (see ``transport.udp``)."""
        timeout = self.gather_timeout if timeout is None else timeout
        wanted = list(peers)
        with self._cond:
            if self.mode == "sync":
                deadline = time.monotonic() + timeout
                while not all(self.reassembler.settled(p, iteration) or p in self.departed for p in wanted):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.stats.gather_timeouts += 1
                        break
                    self._cond.wait(remaining)
            self._taking = True
            try:
                while self._armed is not None:  # the receive thread disarms within one non-blocking read
                    self._cond.wait(0.005)
                taken = self.reassembler.take(iteration, wanted, newest=self.mode == "async")
            finally:
                self._taking = False
        result, spare = self.reassembler.assemble(taken, self.departed)
        with self._cond:
            self.reassembler.recycle(spare, len(self.peers))
        return result

    def recycle(self, messages: Iterable[Message]) -> None:
        """Take back the buffers of gathered models the caller no longer uses (saves page faults)."""
        with self._cond:
            self.reassembler.recycle([msg.chunks.vector for msg in messages if msg.chunks is not None],
                                     len(self.peers))

    # --- shutdown -------------------------------------------------------------------------

    def extra_stats(self) -> dict[str, int]:
        """UDP counters for the run log: datagrams, chunks lost, emulated and buffer drops."""
        return {
            "datagrams_sent": self.sender.datagrams_sent, "datagrams_received": self.datagrams_received,
            "chunks_lost": self.reassembler.chunks_lost, "late_chunks_used": self.reassembler.late_chunks_used,
            "chunks_refused": self.reassembler.chunks_refused,
            "emulated_drops": self.sender.emulated_drops, "rcvbuf_drops": self.rcvbuf_drops,
        }

    def close(self) -> None:
        if self._closed or self._sock is None:
            return
        self._closed = True
        try:
            for addr in self._addrs.values():
                for _ in range(3):  # BYE may be lost too; it only spares the neighbours a timeout
                    self.sender.send_control(Kind.BYE, addr)
            deadline = time.monotonic() + 2.0
            while self.sender.pending and time.monotonic() < deadline:  # let delayed datagrams go out
                time.sleep(0.01)
        finally:
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            with self.sender.cond:
                self.sender.cond.notify_all()
            for thread in self._threads:
                thread.join(timeout=2.0)
            self._sock.close()

