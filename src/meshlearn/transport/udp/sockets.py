"""The UDP socket of a node: bound, with a receive buffer large enough not to drop what arrives
while the node trains; read with one copy per datagram, with the kernel's count of what it dropped."""

from __future__ import annotations

import errno
import logging
import socket
import struct

from meshlearn.errors import PortInUseError, TransportError
from meshlearn.wire.datagram import HEADER_SIZE, MAX_DATAGRAM

log = logging.getLogger(__name__)
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SNDBUF_BYTES = 4 * 1024 * 1024


def open_socket(host: str, port: int, rcvbuf_bytes: int, node_id: int = 0) -> socket.socket:
    """A non-blocking UDP socket bound to ``host:port`` (port 0: any free one); PortInUseError or
    TransportError when it cannot be."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _size_receive_buffer(sock, rcvbuf_bytes, node_id)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)  # each datagram carries the kernel's drop count
    except OSError:
        pass
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(f"UDP port {port} on {host} is in use: choose another port") from None
        raise TransportError(f"node {node_id}: cannot listen on {host}:{port}: {exc}") from None
    sock.setblocking(False)
    return sock


def _size_receive_buffer(sock: socket.socket, wanted: int, node_id: int) -> None:
    """Ask for ``wanted`` bytes: forced when root, else capped by net.core.rmem_max (warned)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, wanted)
        return
    except OSError:
        pass
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, wanted)
    granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2
    if granted < wanted:
        log.warning("node %d: UDP receive buffer capped at %d bytes by net.core.rmem_max (asked %d); raise it "
                    "(sysctl -w net.core.rmem_max=%d) or run as root to avoid self-inflicted loss",
                    node_id, granted, wanted, wanted)


def rcvbuf_errors() -> int:
    """The kernel's UDP RcvbufErrors counter for this network namespace (/proc/net/snmp)."""
    try:
        lines = [line.split() for line in open("/proc/net/snmp") if line.startswith("Udp:")]
        return int(lines[1][lines[0].index("RcvbufErrors")])
    except (OSError, ValueError, IndexError):
        return -1


class DatagramReader:
    """Reads a socket's datagrams with one copy: the header into a buffer of its own, the payload
    straight into a slot the caller guesses for it (else into a spill buffer)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.head = memoryview(bytearray(HEADER_SIZE))
        self.rcvbuf_drops = 0  # the kernel's count of datagrams it dropped for this socket
        self._spill = memoryview(bytearray(MAX_DATAGRAM + 1))
        self._joined = memoryview(bytearray(MAX_DATAGRAM + 1))
        self._ancillary = socket.CMSG_SPACE(4)

    def read(self, slot: memoryview | None) -> tuple[int, memoryview, bool]:
        """Read one datagram: (its size, where its payload lies, whether the payload filled
        ``slot`` exactly). Raises BlockingIOError when none is waiting."""
        buffers = [self.head, slot, self._spill] if slot is not None else [self.head, self._spill]
        size, ancdata, _, _ = self.sock.recvmsg_into(buffers, self._ancillary)
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(data) >= 4:
                self.rcvbuf_drops = struct.unpack("<I", data[:4])[0]
        payload = max(0, size - HEADER_SIZE)
        if slot is None:
            return size, self._spill[:payload], False
        if payload <= len(slot):
            return size, slot[:payload], payload == len(slot)
        self._joined[:len(slot)] = slot  # longer than the slot guessed for it: the rest went to spill
        self._joined[len(slot):payload] = self._spill[:payload - len(slot)]
        return size, self._joined[:payload], False
