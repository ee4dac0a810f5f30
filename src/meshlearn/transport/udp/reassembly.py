"""Reassembling models from UDP chunks: no sockets, no threads, no clock.

``Reassembler`` is fed datagrams (a parsed header and its payload) and hands out, per gather,
the model each neighbour sent for an iteration, with the chunks that never arrived marked (and
reading as zeros). The transport's receive thread feeds it and its ``gather`` takes from it,
both under the transport's lock; tests feed it datagrams directly.

Rules (see ``transport.udp`` for why):

- a chunk for an iteration older than the last one taken is stale, except that with ``late``
  the one just before it is kept: its chunks fill the same sender's gaps at the next take;
- in ``newest`` mode (UDP's async gather) a take gets each sender's newest model so far;
- reassembly buffers are pooled (two per neighbour), since fresh ones cost page faults;
- a chunk that arrived damaged (it did not open, or failed its checksum) is *refused*: UDP sends
  nothing again, so a sync gather waits for it no more (``settled``), and it reads as missing
  unless a whole copy of it comes before the take. Its header is unauthenticated, so a wrong one
  can only end a wait early, as a lost chunk does; refusals are kept for iterations not yet taken,
  ``MAX_PENDING_PER_SENDER`` a sender, one mark a chunk at most.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from meshlearn.errors import WireError
from meshlearn.layout import TensorLayout, zero_lost_chunks
from meshlearn.transport.base import MAX_PENDING_PER_SENDER, TransportStats
from meshlearn.wire import Chunks, Kind, Message
from meshlearn.wire.datagram import ChunkHeader, chunk_count


class Partial:
    """The chunks of one (sender, iteration) message received so far."""

    def __init__(self, header: ChunkHeader, buffer: torch.Tensor):
        self.header = header
        self.buffer = buffer  # uint8, the message's bytes
        self.bytes = memoryview(buffer.numpy())
        self.present = bytearray(header.count)  # plain bytes: torch indexing costs microseconds per chunk
        self.received = 0

    def add(self, header: ChunkHeader, payload: memoryview, in_place: bool = False) -> bool:
        """Store one chunk (``in_place``: the socket already wrote it to its slot); returns
        whether this chunk completed the message (a duplicate never does)."""
        if header.chunk_bytes != self.header.chunk_bytes or header.total != self.header.total:
            raise WireError("chunk geometry changed within one message")
        if self.present[header.index]:
            return False
        if not in_place:
            start = header.index * header.chunk_bytes
            self.bytes[start:start + len(payload)] = payload
        self.present[header.index] = 1
        self.received += 1
        return self.complete

    def slot(self, index: int) -> memoryview:
        """The bytes chunk ``index`` occupies in the buffer."""
        start = index * self.header.chunk_bytes
        return self.bytes[start:start + min(self.header.chunk_bytes, self.header.total - start)]

    @property
    def complete(self) -> bool:
        return self.received == self.header.count

    @property
    def missing(self) -> int:
        return self.header.count - self.received

    def fill_from(self, older: "Partial") -> int:
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

    def message(self, layout: TensorLayout) -> Message:
        """The message as received so far; lost chunks read as zeros (a recycled buffer's old
        bytes could be NaN, and averaging multiplies them by a zero weight). Its ``chunks.vector``
        is the whole payload: of the layout's dtype where it has one (a model), else its bytes."""
        if not self.complete:
            zero_lost_chunks(self.buffer, (i for i, here in enumerate(self.present) if not here),
                             self.header.chunk_bytes)
        present = torch.frombuffer(self.present, dtype=torch.bool) if self.present else torch.ones(0, dtype=torch.bool)
        vector = self.buffer if layout.dtype is None else self.buffer.view(layout.dtype)
        return Message(Kind.MODEL, self.header.sender, self.header.iteration, self.header.degree,
                       layout.views(self.buffer), chunks=Chunks(self.header.chunk_bytes, present, vector))


Slot = tuple[Partial, int, memoryview]  # where the next datagram most likely goes


@dataclass
class Taken:
    """What one take removed: this iteration's message per sender (None if nothing came) and,
    with ``late``, the previous iteration's messages whose chunks may fill its gaps."""

    parts: dict[int, Partial | None]
    late: dict[int, Partial]


class Reassembler:
    """Per-(sender, iteration) reassembly of one node's incoming models (see the module docstring)."""

    def __init__(self, layout: TensorLayout, chunk_bytes: int, stats: TransportStats | None = None,
                 late: bool = True, pool_size: int = 2):
        self.layout = layout
        self.expected_chunks = chunk_count(layout.nbytes, chunk_bytes)
        self.stats = stats or TransportStats()  # stale_dropped is counted there
        self.late = late
        self.pool_size = pool_size
        self.parts: dict[tuple[int, int], Partial] = {}
        self.floor = 0  # iterations below this were taken (or given up)
        self.chunks_lost = 0
        self.late_chunks_used = 0
        self.chunks_refused = 0  # damaged chunks noted, so not waited for
        self.refused: dict[tuple[int, int], set[int]] = {}  # (sender, iteration) -> chunks that came damaged
        self._free: list[torch.Tensor] = []

    # --- feeding -----------------------------------------------------------------------------

    def add(self, header: ChunkHeader, payload: memoryview, in_place: bool = False) -> tuple[bool, Slot | None]:
        """Store one model chunk. Returns whether it completed its message and, if not, the slot
        of the chunk after it when that one is still missing (its message, index and bytes): the
        receive thread reads the next datagram straight there. A chunk of a stale iteration is
        dropped and counted; one that does not fit the layout raises WireError."""
        if header.total != self.layout.nbytes:
            raise WireError(f"a {header.total}-byte model does not match the {self.layout.nbytes}-byte layout")
        if header.chunk_bytes % 8:  # so no value of the layout straddles two chunks
            raise WireError(f"chunk size {header.chunk_bytes} is not a multiple of 8")
        if header.iteration < self.floor - self.late:  # one iteration late is kept
            self.stats.stale_dropped += 1
            return False, None
        key = (header.sender, header.iteration)
        part = self.parts.get(key)
        if part is None:
            if not self._make_room(header):
                return False, None
            buffer = self._free.pop() if self._free else torch.empty(self.layout.nbytes, dtype=torch.uint8)
            part = self.parts[key] = Partial(header, buffer)
        if part.add(header, payload, in_place):
            return True, None
        following = header.index + 1
        if following >= header.count or part.present[following]:
            return False, None
        return False, (part, following, part.slot(following))

    def refuse(self, header: ChunkHeader) -> bool:
        """Note a model chunk that came damaged, so it is not waited for (see the module docstring);
        returns whether it was noted (a chunk of this layout's geometry, of an iteration not taken yet)."""
        if header.kind != Kind.MODEL or header.total != self.layout.nbytes or header.count != self.expected_chunks \
                or header.iteration < self.floor:
            return False
        key = (header.sender, header.iteration)
        refused = self.refused.get(key)
        if refused is None:
            if sum(sender == header.sender for sender, _ in self.refused) >= MAX_PENDING_PER_SENDER:
                return False
            refused = self.refused[key] = set()
        if header.index not in refused:
            refused.add(header.index)
            self.chunks_refused += 1
        return True

    def complete(self, sender: int, iteration: int) -> bool:
        part = self.parts.get((sender, iteration))
        return part is not None and part.complete

    def settled(self, sender: int, iteration: int) -> bool:
        """Whether nothing more is to come of ``sender``'s model for ``iteration``: every chunk is in,
        or came damaged (refused)."""
        key = (sender, iteration)
        part, refused = self.parts.get(key), self.refused.get(key, ())
        if part is None:
            return len(refused) >= self.expected_chunks
        return part.received + sum(index < len(part.present) and not part.present[index]
                                   for index in refused) >= part.header.count

    # --- taking ------------------------------------------------------------------------------

    def take(self, iteration: int, senders: Iterable[int], newest: bool = False) -> Taken:
        """Remove ``iteration``'s messages of ``senders`` (or, ``newest``, each one's newest so
        far), and with ``late`` the previous iteration's; drop anything older."""
        senders = list(senders)
        late: dict[int, Partial] = {}
        if newest:
            parts = {s: self._pop_newest(s, iteration) for s in senders}
        else:
            parts = {s: self.parts.pop((s, iteration), None) for s in senders}
            if self.late:
                late = {s: part for s in senders if (part := self.parts.pop((s, iteration - 1), None))}
        self.floor = max(self.floor, iteration + 1)
        for key in [k for k in self.parts if k[1] < self.floor]:
            self.stats.stale_dropped += 1
            self._free.append(self.parts.pop(key).buffer)
        self.refused = {key: chunks for key, chunks in self.refused.items() if key[1] >= self.floor}
        return Taken(parts, late)

    def assemble(self, taken: Taken, departed: set[int] = frozenset()) -> tuple[dict[int, Message], list[torch.Tensor]]:
        """The messages of a take, gaps filled from late chunks where possible, and the buffers
        that are free again (hand them to ``recycle``). Counts lost and late-used chunks. Works
        only on what ``take`` removed, so it needs no lock."""
        result, spare = {}, []
        for sender, part in taken.parts.items():
            lost = self.expected_chunks if part is None else part.missing
            if part is None and sender in departed:
                lost = 0
            self.chunks_lost += lost
            behind = taken.late.get(sender)
            if behind is not None and lost:
                if part is None:
                    part, behind = behind, None
                    self.late_chunks_used += part.received
                else:
                    self.late_chunks_used += part.fill_from(behind)
            if behind is not None:
                spare.append(behind.buffer)
            if part is not None:
                result[sender] = part.message(self.layout)
        return result, spare

    def recycle(self, vectors: Iterable[torch.Tensor], peers: int) -> None:
        """Pool reassembly buffers for reuse (``vectors``: received payloads, of any dtype),
        ``pool_size`` per neighbour at most."""
        room = self.pool_size * max(1, peers) - len(self._free)
        self._free.extend(vector.view(torch.uint8) for vector in list(vectors)[:max(0, room)])

    def _make_room(self, header: ChunkHeader) -> bool:
        """Whether a new partial model of the header's sender may be started: each sender has at
        most ``MAX_PENDING_PER_SENDER``; over that the furthest iteration is dropped (and counted)."""
        kept = [key[1] for key in self.parts if key[0] == header.sender]
        if len(kept) < MAX_PENDING_PER_SENDER:
            return True
        self.stats.overflow_dropped += 1
        furthest = max(kept)
        if furthest < header.iteration:
            return False
        del self.parts[(header.sender, furthest)]
        return True

    def _pop_newest(self, sender: int, iteration: int) -> Partial | None:
        keys = [k for k in self.parts if k[0] == sender and k[1] <= iteration]
        return self.parts.pop(max(keys, key=lambda k: k[1])) if keys else None
