"""The TCP connections a QUIC path carries, one QUIC stream each, in the path's asyncio loop.

A connection accepted on this side's local port becomes a stream this side opens; a stream the
peer opens becomes a connection to this side's target port. Bytes are copied both ways under
bounds, since aioquic has none of its own: a stream's receive window is what was handed on to its
TCP connection plus STREAM_WINDOW (quicconn.PathConnection), and a stream's sender stops reading
its TCP connection while aioquic holds more than SEND_BACKLOG of its bytes not yet sent. What
arrives from the peer in one batch of datagrams is written to each connection at once.

An end of stream is passed on as a half-close, each way; a connection both of whose directions
ended is closed. A stream exists for the peer from its first byte on (a ZeroMQ peer sends its
greeting at once).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Coroutine
from typing import TYPE_CHECKING

from aioquic.quic import events

from meshlearn.network.channel.quicconn import STREAM_WINDOW
from meshlearn.sparselog import SparseLog

if TYPE_CHECKING:
    from meshlearn.network.channel.quicsession import PathSession

log = logging.getLogger(__name__)

MAX_STREAMS = 8  # TCP connections carried at once each way; beyond, a new one is closed (or its stream refused)
CHUNK = 1 << 16  # bytes read from a local TCP connection at a time
SEND_BACKLOG = 1 << 20  # bytes of a stream aioquic may hold not yet sent before its TCP connection is read again
LOOPBACK = "127.0.0.1"
# application error codes on a stream
STREAM_REFUSED = 0x1  # no target port, or MAX_STREAMS carried already
STREAM_BROKEN = 0x2  # the local TCP connection failed, or the peer ended the stream abruptly


class Carried:
    """One TCP connection carried over one QUIC stream, and how far each direction got."""

    def __init__(self, stream_id: int, writer: asyncio.StreamWriter | None = None):
        self.stream_id = stream_id
        self.writer = writer
        self.inbox: list[bytes] = []  # from the peer, not yet written (the connection is being dialed, or
        # the datagrams at hand are being handled): within the stream window
        self.handed = 0  # bytes from the peer given to the local connection
        self.given = 0  # bytes from the local connection given to aioquic
        self.eof_in = False  # the peer finished sending
        self.eof_out = False  # the local connection finished sending
        self.draining = False
        self.room = asyncio.Event()  # set while aioquic holds at most SEND_BACKLOG unsent
        self.tasks: set[asyncio.Task] = set()

    def consumed(self) -> int:
        """Bytes from the peer the local connection has taken (no longer buffered here)."""
        return 0 if self.writer is None else self.handed - self.writer.transport.get_write_buffer_size()


class StreamCarrier:
    """The connections one path carries. ``link`` is the path's session: its connection
    (``conn``), ``transmit``/``transmit_soon``, its role and address. Counters: ``sent_bytes``
    (local connections -> peer), ``received_bytes`` (peer -> local connections)."""

    def __init__(self, link: PathSession):
        self.link = link
        self.sent_bytes = self.received_bytes = 0
        self._streams: dict[int, Carried] = {}
        self._gone: set[int] = set()  # peer streams refused or aborted: late data for them is dropped
        self._to_flush: set[Carried] = set()
        self._target: int | None = None
        self._target_host = LOOPBACK
        self._listener: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._serving = self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self._warn = SparseLog(log)

    # --- called by the session ---

    def expose(self, target: int | None, listener: socket.socket, host: str = LOOPBACK) -> None:
        """Carry the peer's streams to ``target`` (a port on ``host``, this machine; None: refuse
        them), and connections to ``listener`` to the peer (once ``serve`` was called)."""
        self._target, self._listener, self._target_host = target, listener, host
        if self._closed:
            listener.close()
        elif self._serving:
            self._spawn(self._start_server())

    def serve(self) -> None:
        """The path is ready: accept local connections from now on."""
        self._serving = True
        if self._listener is not None:
            self._spawn(self._start_server())

    def allowance(self, stream_id: int) -> int | None:
        """The highest offset the peer may send on the stream (None: a stream nobody carries)."""
        carried = self._streams.get(stream_id)
        return None if carried is None else carried.consumed() + STREAM_WINDOW

    def held_bytes(self) -> int:
        """Bytes held in this process for the connections carried: in aioquic to send, and from the
        peer not yet taken by the local connections (each stream's share is bounded: SEND_BACKLOG
        plus what is in flight, and STREAM_WINDOW)."""
        conn = self.link.conn
        return sum(conn.held(carried.stream_id) + sum(map(len, carried.inbox))
                   + (carried.handed - carried.consumed()) for carried in self._streams.values())

    def wake_senders(self) -> None:
        """After datagrams went out: streams whose backlog fell back under SEND_BACKLOG read on."""
        for carried in self._streams.values():
            if not carried.room.is_set() and self.link.conn.unsent(carried.stream_id, carried.given) <= SEND_BACKLOG:
                carried.room.set()

    def stream_data(self, event: events.StreamDataReceived) -> None:
        """Bytes (or the end) of a stream from the peer: kept for ``flush``."""
        carried = self._streams.get(event.stream_id) or self._incoming(event.stream_id)
        if carried is None:
            return
        if event.data:
            carried.inbox.append(event.data)
        carried.eof_in = carried.eof_in or event.end_stream
        self._to_flush.add(carried)

    def stream_ended(self, stream_id: int) -> None:
        """The peer reset the stream or asked this side to stop sending: its connection goes."""
        carried = self._streams.get(stream_id)
        if carried is not None:
            self._abort(carried, STREAM_BROKEN)

    def flush(self) -> None:
        """Write what came from the peer, one write per connection (a connection still being
        dialed keeps it: the stream window bounds it)."""
        flushing, self._to_flush = self._to_flush, set()
        for carried in flushing:
            if carried.writer is None:
                self._to_flush.add(carried)
            elif self._streams.get(carried.stream_id) is carried:
                self._write(carried)

    async def close(self) -> None:
        """Close every connection carried and the local port, and end their work."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        elif self._listener is not None:
            self._listener.close()
        for carried in list(self._streams.values()):
            self._forget(carried)
        tasks = [task for task in self._tasks if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- the work ---

    def _spawn(self, work: Coroutine, carried: Carried | None = None) -> None:
        task = asyncio.get_running_loop().create_task(work)
        for group in (self._tasks, carried.tasks if carried else None):
            if group is not None:
                group.add(task)
                task.add_done_callback(group.discard)

    def _opened_here(self, stream_id: int) -> bool:
        """Whether this side opened the stream (bit 0 of its id: 0 for the client's, RFC 9000 2.1)."""
        return (stream_id & 1) == (0 if self.link.is_client else 1)

    def _count(self, mine: bool) -> int:
        """Streams carried that this side opened (``mine``), or that the peer opened."""
        return sum(1 for stream_id in self._streams if self._opened_here(stream_id) == mine)

    async def _start_server(self) -> None:
        if self._server is None and not self._closed:
            self._server = await asyncio.start_server(self._accepted, sock=self._listener)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A local connection: a new stream to the peer, or closed when MAX_STREAMS are carried."""
        if self._closed or self._count(mine=True) >= MAX_STREAMS:
            self._warn.warning("full", "QUIC path to %s: %d connections carried already: one more closed",
                               self.link.where, MAX_STREAMS)
            writer.transport.abort()
            return
        conn = self.link.conn
        stream_id = conn.get_next_available_stream_id()
        conn.send_stream_data(stream_id, b"")  # takes the id: the next connection gets the next one
        carried = self._streams[stream_id] = Carried(stream_id, writer)
        _no_delay(writer)
        self._spawn(self._pump(carried, reader), carried)

    def _incoming(self, stream_id: int) -> Carried | None:
        """A stream the peer opened: carried to the target port, or refused."""
        if stream_id in self._gone or self._opened_here(stream_id):
            return None  # late data for a stream that is over
        if self._target is None or self._count(mine=False) >= MAX_STREAMS:
            self._warn.warning("refused", "QUIC path to %s: a stream from the peer refused (%s)", self.link.where,
                               "nothing exposed" if self._target is None else f"{MAX_STREAMS} carried already")
            self._abort(Carried(stream_id), STREAM_REFUSED)
            return None
        carried = self._streams[stream_id] = Carried(stream_id)
        self._spawn(self._dial(carried), carried)
        return carried

    async def _dial(self, carried: Carried) -> None:
        try:
            reader, writer = await asyncio.open_connection(self._target_host, self._target)
        except OSError as exc:
            self._warn.warning("dial", "QUIC path to %s: the local port %s cannot be reached (%s)", self.link.where,
                               self._target, exc)
            self._abort(carried, STREAM_BROKEN)
            return
        if self._streams.get(carried.stream_id) is not carried:  # aborted meanwhile
            writer.transport.abort()
            return
        carried.writer = writer
        _no_delay(writer)
        self._write(carried)
        self._spawn(self._pump(carried, reader), carried)

    def _write(self, carried: Carried) -> None:
        """Bytes from the peer to the local connection, then its end if the peer's stream ended."""
        data = b"".join(carried.inbox)
        carried.inbox.clear()
        carried.writer.write(data)
        carried.handed += len(data)
        self.received_bytes += len(data)
        if carried.writer.transport.get_write_buffer_size() and not carried.draining:
            carried.draining = True
            self._spawn(self._drain(carried), carried)
        if carried.eof_in:
            self._end_output(carried)

    async def _drain(self, carried: Carried) -> None:
        """Wait for the local connection to take what waits for it, then let the peer send on."""
        try:
            await carried.writer.drain()
        except ConnectionError:
            self._abort(carried, STREAM_BROKEN)
            return
        carried.draining = False
        self.link.transmit()  # the window moved on: MAX_STREAM_DATA goes out

    async def _pump(self, carried: Carried, reader: asyncio.StreamReader) -> None:
        """Bytes from the local connection to the peer, while aioquic's backlog allows."""
        conn = self.link.conn
        try:
            while data := await reader.read(CHUNK):
                conn.send_stream_data(carried.stream_id, data)
                carried.given += len(data)
                self.sent_bytes += len(data)
                self.link.transmit_soon()
                if conn.unsent(carried.stream_id, carried.given) > SEND_BACKLOG:
                    carried.room.clear()
                    await carried.room.wait()
            conn.send_stream_data(carried.stream_id, b"", end_stream=True)
        except (ConnectionError, RuntimeError, ValueError):  # the local connection, or the stream, broke
            self._abort(carried, STREAM_BROKEN)
            return
        self.link.transmit_soon()
        carried.eof_out = True
        self._done_if_over(carried)

    def _end_output(self, carried: Carried) -> None:
        if carried.writer.can_write_eof():
            carried.writer.write_eof()
        self._done_if_over(carried)

    def _done_if_over(self, carried: Carried) -> None:
        if carried.eof_in and carried.eof_out:
            self._forget(carried, close=True)

    def _abort(self, carried: Carried, code: int) -> None:
        """End a stream both ways (RESET_STREAM, STOP_SENDING) and its local connection."""
        for end in (self.link.conn.reset_stream, self.link.conn.stop_stream):
            try:
                end(carried.stream_id, code)
            except ValueError:  # that direction is over already
                pass
        self._gone.add(carried.stream_id)
        self._forget(carried)
        self.link.transmit_soon()

    def _forget(self, carried: Carried, close: bool = False) -> None:
        """Drop the stream's record and close its connection (``close``: after what waits is sent)."""
        self._streams.pop(carried.stream_id, None)
        for task in carried.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if carried.writer is not None:
            if close:
                carried.writer.close()
            else:
                carried.writer.transport.abort()


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
