"""The inside of a QUIC path (quicpath.py): its life in its asyncio loop.

``PathSession`` is the UDP endpoint on the punched socket (datagrams from any address but the
peer's are dropped: a NAT that moves the peer's mapping ends the path at its idle timeout), the one
QUIC connection over it (``PathConnection``, quicconn.py) from the handshake to the close, the
check of the peer's certificate against its pin, and the keep-alive PINGs. The connections the
path carries are its ``carrier``'s (quicstreams.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import socket
import threading
from dataclasses import dataclass

from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.packet import QuicErrorCode, QuicPacketType, pull_quic_header

from meshlearn.errors import KeyMismatch, NetworkError, Unreachable
from meshlearn.network.channel.quicconn import (
    PathCertificate,
    PathConnection,
    matches_pin,
    path_configuration,
)
from meshlearn.network.channel.quicstreams import StreamCarrier

log = logging.getLogger(__name__)

READ_BATCH = 64  # datagrams read per wake-up before the connection answers (one ACK, one write per stream)
DATAGRAM_MAX = 65535  # bytes of the largest UDP datagram
UDP_BUFFER = 2 << 20  # bytes asked for the socket's kernel buffers each way (a burst of the peer's is not dropped)
SMALLEST_INITIAL = 1200  # bytes: a client's first datagram is padded to at least this (RFC 9000 14.1)
# application error codes on the connection
CLOSED = 0x0  # the owner closed the path
PEER_CLOSED = "the peer closed the path"  # the reason phrase sent with CLOSED, as the peer will read it
REASON_CHARS = 200  # characters of a reason phrase kept
PIN_REFUSED = 0x10  # the peer's certificate is not the pinned one
IDLE_SLACK = 0.9  # an end this long (times the idle timeout) after the peer's last packet is the idle timeout's
CONFIRM_PING = 0  # uid of the PING whose acknowledgement says the peer accepted this side


class QuicPathError(NetworkError):
    """A QUIC path that could not be opened, or that ended."""


class QuicHandshakeTimeout(QuicPathError, Unreachable):
    """No QUIC handshake with the peer before the deadline: the UDP path is closed, or nobody answers."""


class QuicPinMismatch(QuicPathError, KeyMismatch):
    """The peer's certificate is not the one whose fingerprint was pinned through the control channel."""


@dataclass(frozen=True)
class PathTimes:
    """The path's clocks, in seconds: the handshake's deadline, the keep-alive PING's period (it
    keeps the NAT's UDP mapping), and how long without a packet from the peer ends the path."""

    handshake: float
    keepalive: float
    idle: float


class PathSession:
    """One side of a path, from the handshake to the end, in the path's loop. ``run()`` is its
    life: ``ready`` (a concurrent future) is resolved once the peer is proven and has accepted
    this side, or fails with the reason; ``ended`` is set once everything is closed."""

    def __init__(self, sock: socket.socket, peer: tuple[str, int], is_client: bool, own: PathCertificate,
                 pin: bytes, times: PathTimes):
        self.peer, self.is_client, self.times = peer, is_client, times
        self._sock, self._own, self._pin = sock, own, pin
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.ended = threading.Event()
        self.why = ""  # why the path ended
        self.keepalives = 0  # keep-alive PINGs the peer acknowledged
        self.strays = 0  # datagrams from other addresses, dropped
        self.conn: PathConnection | None = None
        self.carrier = StreamCarrier(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        self._keeping_alive: asyncio.Task | None = None
        self._last_heard = 0.0  # loop time of the last datagram from the peer
        self._confirmed: asyncio.Future[None] | None = None
        self._finished: asyncio.Event | None = None
        self._terminated = False  # aioquic has ended the connection (no CONNECTION_CLOSE to send)
        self._close_code = CLOSED
        self._timer: asyncio.TimerHandle | None = None
        self._transmit_handle: asyncio.Handle | None = None
        self._pings = itertools.count(CONFIRM_PING + 1)
        self._early_finish = ""  # finish() asked before run() began

    @property
    def where(self) -> str:
        return f"{self.peer[0]}:{self.peer[1]}"

    # --- life ---

    async def run(self) -> None:
        """Open the path, serve it until ``finish``, then close everything."""
        self._loop = asyncio.get_running_loop()
        self._confirmed, self._finished = self._loop.create_future(), asyncio.Event()
        self._configuration = path_configuration(self.is_client, self._own, self.times.idle)
        if self._early_finish:
            self.finish(self._early_finish)
        try:
            await self._open()
            self.ready.set_result(None)
            self._keeping_alive = self._loop.create_task(self._keep_alive())
            self.carrier.serve()
            await self._finished.wait()
        except QuicPathError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug: the path ends, the owner hears one line
            log.exception("QUIC path to %s failed", self.where)
            self._fail(QuicPathError(f"the QUIC path to {self.where} failed: {exc}"))
        finally:
            await self._shutdown()

    async def _open(self) -> None:
        self._sock.setblocking(False)
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, option, UDP_BUFFER)
        self._loop.add_reader(self._sock.fileno(), self._readable)
        self._reading = True
        if self.is_client:
            self.conn = self._connection()
            self.conn.connect(self.peer, now=self._loop.time())
            self.transmit()
        try:
            await asyncio.wait_for(asyncio.shield(self._confirmed), self.times.handshake)
        except asyncio.TimeoutError:
            raise QuicHandshakeTimeout(
                f"no QUIC handshake with {self.where} within {self.times.handshake:g} s: the UDP path is not "
                "open (punch it again) or the peer's side is not running") from None

    def finish(self, why: str) -> None:
        """End the path (from the loop's thread; again: no effect)."""
        if self._finished is None:
            self._early_finish = self._early_finish or why
            return
        if self._finished.is_set():
            return
        self.why = self.why or why
        if not self._confirmed.done():
            self._confirmed.set_exception(QuicPathError(f"the QUIC path to {self.where} ended before it was "
                                                        f"ready: {self.why}"))
        self._finished.set()

    def _fail(self, exc: QuicPathError) -> None:
        self.why = self.why or str(exc)
        if not self.ready.done():
            self.ready.set_exception(exc)

    async def _shutdown(self) -> None:
        if self._confirmed.done() and not self._confirmed.cancelled():
            self._confirmed.exception()  # seen (asyncio would log an exception nobody retrieved)
        if self.conn is not None and not self._terminated:
            said = PEER_CLOSED if self._close_code == CLOSED else self.why
            self.conn.close(error_code=self._close_code, reason_phrase=said[:REASON_CHARS])
            self.transmit()
        for handle in (self._timer, self._transmit_handle, self._keeping_alive):
            if handle is not None:
                handle.cancel()
        await self.carrier.close()
        if self._reading:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        await asyncio.sleep(0)  # the transports' closing callbacks run: their sockets are closed
        self.ended.set()

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.times.keepalive)
            self.conn.send_ping(next(self._pings))
            self.transmit()

    # --- the UDP endpoint and the connection ---

    def _connection(self, original_cid: bytes | None = None) -> PathConnection:
        return PathConnection(configuration=self._configuration, allowance=self.carrier.allowance,
                              original_destination_connection_id=original_cid)

    def _readable(self) -> None:
        """Datagrams wait: up to READ_BATCH go to the connection (the peer's only), then it answers."""
        try:
            for _ in range(READ_BATCH):
                try:
                    data, addr = self._sock.recvfrom(DATAGRAM_MAX)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:  # an ICMP error (the peer's port closed): the idle timeout decides
                    log.debug("QUIC path to %s: %s", self.where, exc)
                    continue
                self._received(data, addr)
            if self.conn is not None:
                self._handle_events()
                self.transmit()
        except Exception as exc:  # a bug: end the path rather than leave it half served
            log.exception("QUIC path to %s: datagrams could not be handled", self.where)
            self.finish(f"internal error: {exc}")

    def _received(self, data: bytes, addr: tuple) -> None:
        if tuple(addr[:2]) != tuple(self.peer[:2]) or self._finished.is_set():
            self.strays += 1
            return
        if self.conn is None and not self._accept(data):
            return
        self._last_heard = self._loop.time()
        self.conn.receive_datagram(data, addr, now=self._last_heard)

    def _accept(self, data: bytes) -> bool:
        """(server) Whether ``data`` is a client's Initial packet: if so, the connection is made for it."""
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=self._configuration.connection_id_length)
        except ValueError:
            return False
        if header.packet_type != QuicPacketType.INITIAL or len(data) < SMALLEST_INITIAL:
            return False
        self.conn = self._connection(header.destination_cid)
        return True

    def transmit(self) -> None:
        """Send what the connection has to send, re-arm its timer, and let blocked senders read on."""
        self._transmit_handle = None
        if self.conn is None or self._sock.fileno() < 0:
            return
        for data, addr in self.conn.datagrams_to_send(now=self._loop.time()):
            try:
                self._sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                break  # the kernel's buffer is full: what is left counts as lost, and is sent again
            except OSError as exc:
                log.debug("QUIC path to %s: %s", self.where, exc)
        if self._timer is not None:
            self._timer.cancel()
        when = self.conn.get_timer()
        self._timer = None if when is None else self._loop.call_at(when, self._on_timer)
        self.carrier.wake_senders()

    def transmit_soon(self) -> None:
        """Have ``transmit`` run once the loop is done with what it is doing (writes coalesce)."""
        if self._transmit_handle is None and self._loop is not None:
            self._transmit_handle = self._loop.call_soon(self.transmit)

    def _on_timer(self) -> None:
        self._timer = None
        self.conn.handle_timer(now=self._loop.time())
        self._handle_events()
        self.transmit()

    def _handle_events(self) -> None:
        while (event := self.conn.next_event()) is not None:
            if isinstance(event, events.StreamDataReceived):
                self.carrier.stream_data(event)
            elif isinstance(event, (events.StreamReset, events.StopSendingReceived)):
                self.carrier.stream_ended(event.stream_id)
            elif isinstance(event, events.HandshakeCompleted):
                self._check_peer()
            elif isinstance(event, events.PingAcknowledged):
                self._acknowledged(event.uid)
            elif isinstance(event, events.ConnectionTerminated):
                self._connection_ended(event)
        self.carrier.flush()

    def _check_peer(self) -> None:
        """The handshake is done: refuse a peer whose certificate is not the pinned one, else ask it
        to confirm that it accepted this side (the acknowledgement of CONFIRM_PING)."""
        if matches_pin(self.conn.peer_certificate(), self._pin):
            self.conn.send_ping(CONFIRM_PING)
            return
        self._close_code = PIN_REFUSED  # closed at once: nothing else (an acknowledgement) goes out first
        self.conn.close(error_code=PIN_REFUSED, reason_phrase="certificate does not match the pin")
        self._confirmed.set_exception(QuicPinMismatch(
            f"the peer at {self.where} presented a certificate whose fingerprint is not the one pinned "
            "through the control channel: refused (another party on the path, or stale pinning material)"))
        self.finish("certificate does not match the pin")

    def _acknowledged(self, uid: int) -> None:
        if uid != CONFIRM_PING:
            self.keepalives += 1
        elif not self._confirmed.done():
            self._confirmed.set_result(None)

    def _connection_ended(self, event: events.ConnectionTerminated) -> None:
        self._terminated = True
        if event.error_code == PIN_REFUSED and event.frame_type is None:
            why = "the peer refused this side's certificate (it was given another fingerprint: exchange them again)"
        elif event.error_code == QuicErrorCode.APPLICATION_ERROR and not self._confirmed.done():
            why = ("the peer closed the path during the handshake: it refused this side's certificate (exchange "
                   "fingerprints again), or it was closed")
        elif self._loop.time() - self._last_heard >= self.times.idle * IDLE_SLACK:
            why = (f"no packet from the peer for {self.times.idle:g} s: it is gone, or a NAT on the way forgot "
                   "the path")
        else:
            why = f"the QUIC connection ended: {_printable(event.reason_phrase) or f'code {event.error_code}'}"
        self.finish(why)


def _printable(text: str) -> str:
    """``text`` (a peer's reason phrase) fit for one line of a log: printable, and short."""
    return "".join(char if char.isprintable() else "?" for char in text[:REASON_CHARS])
