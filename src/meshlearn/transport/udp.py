"""Lossy UDP transport: models cut into checksummed datagrams, reassembled chunk by chunk.

A background thread drains the socket into per-(sender, iteration) reassembly buffers all the
time, so datagrams do not pile up in the kernel while the node trains (the cause of the
self-inflicted loss measured in the UDP study). ``gather`` then differs by mode:

- ``sync``: wait until every neighbour's model for this iteration is complete, or the timeout;
  returns the moment the last chunk is in. Chunks that miss their deadline are not thrown away
  (unless ``late=False``, the study's behaviour): they stand in for the same sender's chunks
  missing at the next iteration. Once the timeout cuts every iteration (any loss at all), nodes
  that started a little apart stay apart, and a neighbour's chunks can land just after each
  deadline, iteration after iteration; one iteration late, they are still news.
- ``async``: no waiting; take, per neighbour, the newest model received so far (the study's
  "UDP_threading", kept to reproduce it).

Messages with tensors must follow the state layout given to the transport (a FlatState's
segments); each arrives with ``msg.chunks`` saying which chunks made it.
"""

from __future__ import annotations

import heapq
import logging
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from meshlearn.errors import PortInUseError, TransportError, UserInputError, WireError
from meshlearn.transport.base import DONE, Receipt, Transport
from meshlearn.netem import Emulator, NetemSpec
from meshlearn.wire import DEFAULT_MAX_BYTES, Chunks, Kind, Message
from meshlearn.wire.datagram import (
    FLAG_HEARD, FLAG_REPLY, HEADER_SIZE, MAX_DATAGRAM, ChunkHeader, check_payload, chunk_count, pack_fields,
    pack_header, parse_header,
)

log = logging.getLogger(__name__)
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
# The largest multiple of 8 bytes that, with the 48-byte header and 28 bytes of IP/UDP headers,
# fits one unfragmented IP packet on lo (MTU 65,536): fewer datagrams, fewer syscalls.
LOOPBACK_CHUNK = 65_456
ETHERNET_CHUNK = 1_424  # + 48 + 28 = 1,500: one standard Ethernet frame, no IP fragmentation
HELLO_EVERY = 0.1


def default_chunk_bytes(host: str) -> int:
    """Payload bytes per datagram that fit the path without IP fragmentation."""
    return LOOPBACK_CHUNK if host.startswith("127.") or host == "localhost" else ETHERNET_CHUNK


@dataclass(frozen=True)
class StateLayout:
    """The named segments (element ranges) and dtype of the state vectors a run exchanges."""

    ranges: dict[str, tuple[int, int]]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return max((stop for _, stop in self.ranges.values()), default=0)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class _Reassembly:
    """The chunks of one (sender, iteration) message received so far."""

    def __init__(self, header: ChunkHeader, vector: torch.Tensor):
        self.header = header
        self.vector = vector
        self.bytes = memoryview(self.vector.numpy()).cast("B")
        self.present = bytearray(header.count)  # plain bytes: torch indexing costs microseconds per chunk
        self.received = 0

    def add(self, header: ChunkHeader, payload: memoryview, in_place: bool = False) -> bool:
        """Store one chunk (``in_place``: the socket already wrote it to its slot); returns
        whether the message is now complete."""
        if header.chunk_bytes != self.header.chunk_bytes or header.total != self.header.total:
            raise WireError("chunk geometry changed within one message")
        if not self.present[header.index]:
            if not in_place:
                start = header.index * header.chunk_bytes
                self.bytes[start:start + len(payload)] = payload
            self.present[header.index] = 1
            self.received += 1
        return self.complete

    def slot(self, index: int) -> memoryview:
        """The bytes chunk ``index`` occupies in the vector."""
        start = index * self.header.chunk_bytes
        return self.bytes[start:start + min(self.header.chunk_bytes, self.header.total - start)]

    @property
    def complete(self) -> bool:
        return self.received == self.header.count

    def fill_from(self, older: "_Reassembly") -> int:
        """Copy into this message's missing chunks those that ``older`` (the same sender's
        previous message) has; returns how many."""
        filled = 0
        for index, here in enumerate(self.present):
            if not here and older.present[index]:
                self.slot(index)[:] = older.slot(index)
                self.present[index] = 1
                filled += 1
        self.received += filled
        return filled

    def message(self, layout: StateLayout) -> Message:
        """The message as received so far; lost chunks read as zeros (a recycled buffer's old
        bytes could be NaN, and averaging multiplies them by a zero weight)."""
        if not self.complete:
            size = self.vector.element_size()
            per_chunk = self.header.chunk_bytes // size
            for index in (i for i, here in enumerate(self.present) if not here):
                self.vector[index * per_chunk:(index + 1) * per_chunk].zero_()
        tensors = {name: self.vector[a:b] for name, (a, b) in layout.ranges.items()}
        present = torch.frombuffer(self.present, dtype=torch.bool) if self.present else torch.ones(0, dtype=torch.bool)
        return Message(Kind.MODEL, self.header.sender, self.header.iteration, self.header.degree, tensors,
                       chunks=Chunks(self.header.chunk_bytes, present, self.vector))


class UdpTransport(Transport):
    """Sends each message as checksummed datagrams; tolerates their loss (see module docstring)."""

    def __init__(
        self,
        node_id: int,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        layout: StateLayout,
        chunk_bytes: int = 0,
        mode: str = "sync",
        max_message_bytes: int = DEFAULT_MAX_BYTES,
        handshake_timeout: float = 30.0,
        rcvbuf_bytes: int = 64 * 1024 * 1024,
        rate_bytes_per_s: float = 2e9,
        netem: NetemSpec | None = None,
        seed: int = 0,
        late: bool = True,
    ):
        super().__init__(node_id)
        if mode not in ("sync", "async"):
            raise UserInputError(f"unknown UDP receive mode {mode!r}: use sync or async")
        self.host, self.port = host, port
        self.layout = layout
        self.chunk_bytes = chunk_bytes or default_chunk_bytes(host)
        if not 8 <= self.chunk_bytes <= MAX_DATAGRAM - HEADER_SIZE or self.chunk_bytes % 8:
            raise UserInputError(f"chunk size {self.chunk_bytes} bytes: use a multiple of 8 between 8 and "
                                 f"{(MAX_DATAGRAM - HEADER_SIZE) // 8 * 8}")
        self.mode = mode
        self.late = late and mode == "sync"
        self.max_message_bytes = max_message_bytes
        self.handshake_timeout = handshake_timeout
        self.rcvbuf_bytes = rcvbuf_bytes
        self.rate = rate_bytes_per_s
        self.emulator = Emulator(netem or NetemSpec(), seed * 7919 + node_id)
        # HELLOs are sent a timing-dependent number of times: their own random stream keeps the
        # model datagrams' drop pattern the same from run to run for a given seed.
        self.control_emulator = Emulator(netem or NetemSpec(), seed * 7919 + node_id + 104_729)
        self.address = ""
        self.chunks_lost = 0
        self.late_chunks_used = 0
        self.datagrams_sent = 0
        self.datagrams_received = 0
        self.emulated_drops = 0
        self.rcvbuf_drops = 0
        self._sock: socket.socket | None = None
        self._addrs: dict[int, tuple[str, int]] = {}
        self._cond = threading.Condition()
        self._parts: dict[tuple[int, int], _Reassembly] = {}
        self._free: list[torch.Tensor] = []  # reassembly buffers handed back by recycle()
        self._floor = 0
        self._control: deque[Message] = deque()
        self._heard: set[int] = set()
        self._acked: set[int] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._delayed: list[tuple[float, int, bytes, tuple[str, int]]] = []
        self._seq = 0
        self._closed = False
        # The receive thread reads the next datagram straight into the slot of the chunk it most
        # likely is (the one after the last chunk received), saving a copy per datagram. While a
        # slot is armed its message must stay in _parts; gather sets _taking and waits for disarming.
        self._armed: tuple[_Reassembly, int, memoryview] | None = None
        self._taking = False

    # --- set-up ---------------------------------------------------------------------------

    def bind(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._size_receive_buffer(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
        except OSError:
            pass
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            if exc.errno == 98:
                raise PortInUseError(f"UDP port {self.port} on {self.host} is in use: choose another port") from None
            raise TransportError(f"node {self.node_id}: cannot listen on {self.host}:{self.port}: {exc}") from None
        sock.setblocking(False)  # the receive thread polls; see _receive_loop
        self._sock = sock
        host, port = sock.getsockname()
        self.address = f"udp://{host}:{port}"
        return self.address

    def _size_receive_buffer(self, sock: socket.socket) -> None:
        """Ask for ``rcvbuf_bytes``: forced when root, else capped by net.core.rmem_max (warned)."""
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, self.rcvbuf_bytes)
            return
        except OSError:
            pass
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf_bytes)
        granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2
        if granted < self.rcvbuf_bytes:
            log.warning("node %d: UDP receive buffer capped at %d bytes by net.core.rmem_max (asked %d); raise it "
                        "(sysctl -w net.core.rmem_max=%d) or run as root to avoid self-inflicted loss",
                        self.node_id, granted, self.rcvbuf_bytes, self.rcvbuf_bytes)

    def connect(self, peers: Mapping[int, str]) -> None:
        if self._sock is None:
            raise TransportError("bind() must be called before connect()")
        self.peers = dict(peers)
        for peer, address in self.peers.items():
            host, _, port = address.removeprefix("udp://").rpartition(":")
            self._addrs[peer] = (host, int(port))
        self._start_thread(self._receive_loop, "udp-recv")
        if self.emulator.spec.delay or self.emulator.spec.jitter:
            self._start_thread(self._delay_loop, "udp-delay")
        deadline = time.monotonic() + self.handshake_timeout
        while True:
            with self._cond:
                waiting = self.peers.keys() - self._acked - self.departed
                if not waiting:
                    return
                heard = set(self._heard)
            if time.monotonic() > deadline:
                where = ", ".join(f"{p} at {self.peers[p]}" for p in sorted(waiting))
                raise TransportError(f"node {self.node_id}: neighbour(s) {where} did not answer the handshake "
                                     f"within {self.handshake_timeout:g} s")
            for peer in waiting:
                self._send_control(peer, Kind.HELLO, FLAG_HEARD if peer in heard else 0)
            with self._cond:
                self._cond.wait(HELLO_EVERY)

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=f"{name}-{self.node_id}", daemon=True)
        thread.start()
        self._threads.append(thread)

    # --- sending --------------------------------------------------------------------------

    def _send_control(self, peer: int, kind: Kind, flags: int = 0) -> None:
        header = ChunkHeader(kind, self.node_id, 0, 0, 1, self.chunk_bytes, 0, 0, flags)
        self._emit([pack_header(header)], self._addrs[peer], self.control_emulator)

    def _emit(self, pieces: list, addr: tuple[str, int], emulator: Emulator | None = None) -> None:
        """Send one datagram, through the emulator's loss and delay."""
        emulator = emulator or self.emulator
        if emulator.drop():
            self.emulated_drops += 1
            return
        delay = emulator.delay()
        if delay > 0:
            with self._cond:
                self._seq += 1
                heapq.heappush(self._delayed, (time.monotonic() + delay, self._seq, b"".join(pieces), addr))
                self._cond.notify_all()
            return
        self._send_now(pieces, addr)

    def _send_now(self, pieces: list, addr: tuple[str, int]) -> None:
        try:
            self._sock.sendmsg(pieces, [], 0, addr)
            self.datagrams_sent += 1
        except OSError:  # a full send buffer or an unreachable peer: the datagram is lost
            self.stats.send_dropped += 1

    def send(self, peer: int, msg: Message) -> None:
        self.broadcast([peer], msg)

    def broadcast(self, peers: Iterable[int], msg: Message) -> Receipt:
        """Send a message to each peer as datagrams; returns once they are handed to the kernel
        (or copied into the delay queue), so the tensors may be reused at once."""
        views = [memoryview(t.numpy()).cast("B") for t in msg.tensors.values()]
        total = sum(len(v) for v in views)
        if views and total != self.layout.nbytes:
            raise TransportError(f"node {self.node_id}: a {total}-byte message does not match the "
                                 f"{self.layout.nbytes}-byte state layout")
        count = chunk_count(total, self.chunk_bytes)
        whole = _contiguous(list(msg.tensors.values()), total)
        size, started, sent = self.chunk_bytes, time.monotonic(), 0
        emit = self._emit if self.emulator.spec.active else self._send_now
        heads: list[bytes] = []  # a datagram's header names no receiver: checksum each chunk once
        for peer in peers:
            addr = self._addrs[peer]
            for index in range(count):
                start = index * size
                pieces = [whole[start:start + size]] if whole is not None else _slice(views, start, start + size)
                if len(heads) == index:
                    heads.append(pack_fields(msg.kind, 0, self.node_id, msg.iteration, index, count, size,
                                             msg.degree, total, pieces))
                emit([heads[index], *pieces], addr)
                sent += HEADER_SIZE + min(size, total - start)
                ahead = sent / self.rate - (time.monotonic() - started)
                if ahead > 0.002:  # pace: never more than 2 ms ahead of the configured rate
                    time.sleep(ahead)
            self.stats.messages_sent += 1
        self.stats.bytes_sent += sent
        return DONE

    def _delay_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                now = time.monotonic()
                due = []
                while self._delayed and self._delayed[0][0] <= now:
                    due.append(heapq.heappop(self._delayed))
                if not due:
                    wait = self._delayed[0][0] - now if self._delayed else 0.05
                    self._cond.wait(min(wait, 0.05))
                    continue
            for _, _, data, addr in due:
                try:
                    self._sock.sendto(data, addr)
                    self.datagrams_sent += 1
                except OSError:
                    self.stats.send_dropped += 1

    # --- receiving ------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        head = memoryview(bytearray(HEADER_SIZE))
        spill = memoryview(bytearray(MAX_DATAGRAM + 1))
        joined = memoryview(bytearray(MAX_DATAGRAM + 1))
        ancillary = socket.CMSG_SPACE(4)
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        while not self._stop.is_set():
            armed = self._armed
            try:
                size, ancdata, _, _ = self._sock.recvmsg_into([head, armed[2], spill] if armed else [head, spill],
                                                              ancillary)
            except BlockingIOError:
                if armed is not None:
                    self._disarm()
                poller.poll(100)
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(data) >= 4:
                    self.rcvbuf_drops = struct.unpack("<I", data[:4])[0]
            self.stats.bytes_received += size
            try:
                if size < HEADER_SIZE:
                    raise WireError(f"datagram of {size} bytes is shorter than the {HEADER_SIZE}-byte header")
                header, checksum = parse_header(head, self.max_message_bytes)
                payload, in_place = self._payload(size - HEADER_SIZE, armed, spill, joined)
                check_payload(head, header, checksum, payload)
                in_place = in_place and armed[0].header.sender == header.sender and \
                    armed[0].header.iteration == header.iteration and armed[1] == header.index
                self._accept(header, payload, in_place)
            except WireError as exc:
                self.stats.malformed_dropped += 1
                log.debug("node %d: dropped a malformed datagram: %s", self.node_id, exc)

    @staticmethod
    def _payload(size: int, armed, spill: memoryview, joined: memoryview) -> tuple[memoryview, bool]:
        """Where a received payload of ``size`` bytes lies, and whether it is all in the armed slot."""
        if armed is None:
            return spill[:size], False
        slot = armed[2]
        if size <= len(slot):
            return slot[:size], size == len(slot)
        joined[:len(slot)] = slot  # longer than the slot guessed for it: the rest went to spill
        joined[len(slot):size] = spill[:size - len(slot)]
        return joined[:size], False

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
                if self._add_chunk(header, payload, in_place):  # wake a waiting gather only when a model completes
                    self._cond.notify_all()
                elif self._taking:
                    self._cond.notify_all()
                return
            if header.kind == Kind.HELLO:
                self._heard.add(header.sender)
                if header.flags & FLAG_HEARD:
                    self._acked.add(header.sender)
                if not header.flags & FLAG_REPLY:  # a peer still sending HELLO wants to know we heard it
                    self._send_control(header.sender, Kind.HELLO, FLAG_HEARD | FLAG_REPLY)
            elif header.kind == Kind.BYE:
                self.departed.add(header.sender)
            else:
                self._control.append(Message(header.kind, header.sender, header.iteration, header.degree))
            self._cond.notify_all()

    def _add_chunk(self, header: ChunkHeader, payload: memoryview, in_place: bool) -> bool:
        """Store one chunk of a model and arm the slot of the next; returns whether that model is now complete."""
        if header.total != self.layout.nbytes:
            raise WireError(f"a {header.total}-byte model does not match the {self.layout.nbytes}-byte layout")
        if header.iteration < self._floor - self.late:  # one iteration late is kept; see the module docstring
            self.stats.stale_dropped += 1
            return False
        key = (header.sender, header.iteration)
        part = self._parts.get(key)
        if part is None:
            vector = self._free.pop() if self._free else torch.empty(self.layout.numel, dtype=self.layout.dtype)
            part = self._parts[key] = _Reassembly(header, vector)
        complete = part.add(header, payload, in_place)
        if complete:
            self.stats.messages_received += 1
        else:
            following = header.index + 1
            if following < header.count and not part.present[following] and not self._taking:
                self._armed = (part, following, part.slot(following))
        return complete

    def recv(self, timeout: float) -> Message | None:
        """The next control message (not HELLO, BYE or MODEL: those are handled by the transport)."""
        with self._cond:
            if not self._control:
                self._cond.wait(timeout)
            return self._control.popleft() if self._control else None

    def gather(self, iteration: int, peers: Iterable[int], timeout: float) -> dict[int, Message]:
        wanted = list(peers)
        with self._cond:
            taken, late = self._take(iteration, wanted, timeout)
        expected = chunk_count(self.layout.nbytes, self.chunk_bytes)
        result, spare = {}, []
        for peer, part in taken.items():
            lost = expected if part is None else part.header.count - part.received
            if part is None and peer in self.departed:
                lost = 0
            self.chunks_lost += lost
            behind = late.get(peer)
            if behind is not None and lost:
                if part is None:
                    part, behind = behind, None
                    self.late_chunks_used += part.received
                else:
                    self.late_chunks_used += part.fill_from(behind)
            if behind is not None:
                spare.append(behind.vector)
            if part is not None:
                result[peer] = part.message(self.layout)
        if spare:
            with self._cond:
                self._keep_buffers(spare)
        return result

    def _take(self, iteration: int, wanted: list[int], timeout: float
              ) -> tuple[dict[int, _Reassembly | None], dict[int, _Reassembly]]:
        """gather's part under the lock: wait as the mode says, then remove this iteration's parts,
        the previous iteration's late chunks and anything older, once no datagram is being read
        into any of them."""
        if self.mode == "sync":
            deadline = time.monotonic() + timeout
            while not all(self._done(p, iteration) for p in wanted):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.stats.gather_timeouts += 1
                    break
                self._cond.wait(remaining)
        self._taking = True
        try:
            while self._armed is not None:  # the receive thread disarms within one non-blocking read
                self._cond.wait(0.005)
            late = {}
            if self.mode == "sync":
                taken = {p: self._parts.pop((p, iteration), None) for p in wanted}
                if self.late:
                    late = {p: part for p in wanted if (part := self._parts.pop((p, iteration - 1), None))}
            else:
                taken = {p: self._newest(p, iteration) for p in wanted}
            self._floor = max(self._floor, iteration + 1)
            for key in [k for k in self._parts if k[1] < self._floor]:
                self.stats.stale_dropped += 1
                self._free.append(self._parts.pop(key).vector)
        finally:
            self._taking = False
        return taken, late

    def recycle(self, messages: Iterable[Message]) -> None:
        """Take back the buffers of gathered models the caller no longer uses (saves page faults)."""
        with self._cond:
            self._keep_buffers([msg.chunks.vector for msg in messages if msg.chunks is not None])

    def _keep_buffers(self, vectors: list[torch.Tensor]) -> None:
        """Pool reassembly vectors for reuse, two per neighbour at most (call under the lock)."""
        room = 2 * max(1, len(self.peers)) - len(self._free)
        self._free.extend(vectors[:max(0, room)])

    def _done(self, peer: int, iteration: int) -> bool:
        part = self._parts.get((peer, iteration))
        return (part is not None and part.complete) or peer in self.departed

    def _newest(self, peer: int, iteration: int) -> _Reassembly | None:
        keys = [k for k in self._parts if k[0] == peer and k[1] <= iteration]
        if not keys:
            return None
        return self._parts.pop(max(keys, key=lambda k: k[1]))

    # --- shutdown -------------------------------------------------------------------------

    def extra_stats(self) -> dict[str, int]:
        """UDP counters for the run log: datagrams, chunks lost, emulated and buffer drops."""
        return {
            "datagrams_sent": self.datagrams_sent, "datagrams_received": self.datagrams_received,
            "chunks_lost": self.chunks_lost, "late_chunks_used": self.late_chunks_used,
            "emulated_drops": self.emulated_drops,
            "rcvbuf_drops": self.rcvbuf_drops,
        }

    def close(self) -> None:
        if self._closed or self._sock is None:
            return
        self._closed = True
        try:
            for peer in self._addrs:
                for _ in range(3):  # BYE may be lost too; it only spares the neighbours a timeout
                    self._send_control(peer, Kind.BYE)
            deadline = time.monotonic() + 2.0
            while self._delayed and time.monotonic() < deadline:  # let delayed datagrams go out
                time.sleep(0.01)
        finally:
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            for thread in self._threads:
                thread.join(timeout=2.0)
            self._sock.close()


def _slice(views: list[memoryview], start: int, stop: int) -> list[memoryview]:
    """The byte range [start, stop) of the concatenation of ``views``, as views (no copy)."""
    pieces, offset = [], 0
    for view in views:
        end = offset + len(view)
        if end > start and offset < stop:
            pieces.append(view[max(start, offset) - offset:min(stop, end) - offset])
        if end >= stop:
            break
        offset = end
    return pieces


def _contiguous(tensors: list[torch.Tensor], total: int) -> memoryview | None:
    """One byte view over ``tensors`` when they lie back to back in one buffer (a FlatState
    snapshot does), so chunks are plain slices; None otherwise."""
    if not tensors or not all(t.is_contiguous() for t in tensors):
        return None
    address, storage = tensors[0].data_ptr(), tensors[0].untyped_storage().data_ptr()
    for tensor in tensors:
        if tensor.data_ptr() != address or tensor.untyped_storage().data_ptr() != storage:
            return None
        address += tensor.numel() * tensor.element_size()
    first = tensors[0]
    whole = first.as_strided((total // first.element_size(),), (1,), first.storage_offset())
    return memoryview(whole.numpy()).cast("B")


def rcvbuf_errors() -> int:
    """The kernel's UDP RcvbufErrors counter for this network namespace (/proc/net/snmp)."""
    try:
        lines = [line.split() for line in open("/proc/net/snmp") if line.startswith("Udp:")]
        return int(lines[1][lines[0].index("RcvbufErrors")])
    except (OSError, ValueError, IndexError):
        return -1


