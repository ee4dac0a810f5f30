"""Sending over UDP: messages cut into checksummed datagrams, paced, through emulated loss and delay.

No socket of its own: ``DatagramSender`` hands each datagram (a list of byte pieces) to the
function it is given, and keeps delayed datagrams in a ``DelayLine`` until ``release_due``
sends them. Its clock and sleep are injectable, so tests can check pacing and delay without
waiting. Thread-safe: the training thread sends models, the receive thread answers HELLOs and
the delay thread releases delayed datagrams, all counted under one lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from meshlearn.netem import DelayLine, Emulator, LinkRate
from meshlearn.transport.base import TransportStats
from meshlearn.wire import Kind, Message
from meshlearn.wire.datagram import (
    HEADER_SIZE,
    ChunkHeader,
    chunk_count,
    pack_fields,
    pack_header,
)
from meshlearn.wire.sealed_datagram import OVERHEAD, DatagramSeal

Address = tuple[str, int]
SendFn = Callable[[list, Address], None]  # raises OSError when the kernel refuses the datagram
PACE_SLACK = 0.002  # seconds a sender may run ahead of its rate before it sleeps
# Seconds of sending a sender that fell behind its rate (descheduled, or slower than it) may make
# up at full speed; the rest is let go: sent at once, the lag would leave as one burst, which the
# small queue of a slow link's router drops
CATCH_UP = 0.005


@dataclass
class _Tally:
    sent: int = 0
    dropped: int = 0
    failed: int = 0


class DatagramSender:
    """One node's outgoing datagrams (see the module docstring)."""

    def __init__(self, node_id: int, send: SendFn, chunk_bytes: int, rate_bytes_per_s: float, emulator: Emulator,
                 control_emulator: Emulator, stats: TransportStats, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, seal: DatagramSeal | None = None):
        self.node_id = node_id
        self.seal = seal  # network tasks: every datagram sealed with the task's key (wire.sealed_datagram)
        self.chunk_bytes = chunk_bytes
        self.rate = rate_bytes_per_s
        self.emulator = emulator
        # HELLOs are sent a timing-dependent number of times: their own random stream keeps the
        # model datagrams' drop pattern the same from run to run for a given seed.
        self.control_emulator = control_emulator
        self.stats = stats
        self.clock, self.sleep = clock, sleep
        self.datagrams_sent = 0
        self.emulated_drops = 0
        self.delayed = DelayLine()
        # the emulated bandwidth of each link (by address), shared by models and control datagrams
        self.link_rate = LinkRate(emulator.spec.rate) if emulator.spec.rate else None
        self.cond = threading.Condition()  # guards the counters, the delay line and the link clocks
        self._send = send

    def send_model(self, msg: Message, addrs: Iterable[Address], total: int) -> None:
        """Send ``msg`` (``total`` bytes of tensors) to each address as datagrams; returns once
        they are handed to the kernel or copied into the delay line, so the tensors may be reused."""
        tensors = list(msg.tensors.values())
        views = [memoryview(t.numpy()).cast("B") for t in tensors]
        whole = _contiguous(tensors, total)
        size, count = self.chunk_bytes, chunk_count(total, self.chunk_bytes)
        emulator = self.emulator if self.emulator.spec.active else None
        heads: list[list] = []  # a datagram names no receiver: each chunk checksummed (and sealed) once
        tally, started, sent, messages = _Tally(), self.clock(), 0, 0
        for addr in addrs:
            for index in range(count):
                start = index * size
                pieces = [whole[start:start + size]] if whole is not None else _slice(views, start, start + size)
                if len(heads) == index:
                    head = pack_fields(msg.kind, 0, self.node_id, msg.iteration, index, count, size, msg.degree,
                                       total, pieces)
                    heads.append([head, *self.seal.close(head, b"".join(pieces))] if self.seal else [head, *pieces])
                self._emit(heads[index], addr, emulator, tally)
                sent += HEADER_SIZE + min(size, total - start) + (OVERHEAD if self.seal else 0)
                ahead = sent / self.rate - (self.clock() - started)
                if ahead > PACE_SLACK:
                    self.sleep(ahead)
                elif ahead < -CATCH_UP:
                    started -= ahead + CATCH_UP  # behind by CATCH_UP at most: no burst after a stall
            messages += 1
        self._count(tally, messages=messages, nbytes=sent)

    def send_control(self, kind: Kind, addr: Address, flags: int = 0) -> None:
        """Send one header-only datagram (HELLO, BYE) through the control emulator."""
        header = ChunkHeader(kind, self.node_id, 0, 0, 1, self.chunk_bytes, 0, 0, flags)
        tally = _Tally()
        emulator = self.control_emulator if self.control_emulator.spec.active else None
        head = pack_header(header)
        self._emit([head, *self.seal.close(head, b"")] if self.seal else [head], addr, emulator, tally)
        self._count(tally)

    def release_due(self, wait: float = 0.0) -> None:
        """Send the delayed datagrams that are due, first waiting up to ``wait`` seconds for one."""
        with self.cond:
            due = self.delayed.pop_due(self.clock())
            if not due and wait > 0:
                next_due = self.delayed.next_due()
                self.cond.wait(wait if next_due is None else max(0.0, min(wait, next_due - self.clock())))
                due = self.delayed.pop_due(self.clock())
        tally = _Tally()
        for data, addr in due:
            self._send_now([data], addr, tally)
        self._count(tally)

    @property
    def pending(self) -> int:
        """Delayed datagrams not sent yet."""
        with self.cond:
            return len(self.delayed)

    def _emit(self, pieces: list, addr: Address, emulator: Emulator | None, tally: _Tally) -> None:
        """Send one datagram now, or drop or delay it as ``emulator`` says (after its time on the
        link, under an emulated rate: a lost datagram took its time on the link too)."""
        if emulator is not None:
            now = self.clock()
            through = now
            if self.link_rate is not None:
                with self.cond:
                    through = self.link_rate.through(addr, sum(memoryview(p).nbytes for p in pieces), now)
            if emulator.drop():
                tally.dropped += 1
                return
            due = through + emulator.delay()
            if due > now:
                with self.cond:
                    self.delayed.push((b"".join(pieces), addr), due)
                    self.cond.notify_all()
                return
        self._send_now(pieces, addr, tally)

    def _send_now(self, pieces: list, addr: Address, tally: _Tally) -> None:
        try:
            self._send(pieces, addr)
            tally.sent += 1
        except OSError:  # a full send buffer or an unreachable peer: the datagram is lost
            tally.failed += 1

    def _count(self, tally: _Tally, messages: int = 0, nbytes: int = 0) -> None:
        with self.cond:
            self.datagrams_sent += tally.sent
            self.emulated_drops += tally.dropped
            self.stats.send_dropped += tally.failed
            self.stats.messages_sent += messages
            self.stats.bytes_sent += nbytes


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
