"""The relay's few words on the wire, and the socket settings both of its sides use.

A connection to the relay's agent port starts with one short line: ``AGENT token`` (a
participant's agent parking a connection for its allocation) or ``KEY`` (answered with one line,
``meshlearn-bootstrap-key`` and the bootstrap's public key) or ``ADDR`` (answered with one line,
``meshlearn-addr HOST:PORT``: the address and port the connection came from, for a peer behind
NAT to learn its TCP mapping, reflexive.py). A parked connection hears one byte,
``G``, when a client takes it, then the client's first bytes, and from then on whatever the
client sends.
"""

from __future__ import annotations

import socket
import time

from meshlearn.errors import PortInUseError

LINE_MAX = 128  # bytes a first line holds at most
GREETING_TIME = 3.0  # seconds a connection to the agent port has to send its whole first line
LISTEN_BACKLOG = 512
AGENT_REQUEST = b"AGENT"  # followed by the allocation's token
GO = b"G"  # to a parked connection: a client took it
KEY_REQUEST = b"KEY"
KEY_REPLY = b"meshlearn-bootstrap-key "
ADDR_REQUEST = b"ADDR"
ADDR_REPLY = b"meshlearn-addr "  # followed by HOST:PORT, the connection's source as the relay sees it
# TCP keepalives: a connection whose other end vanished is noticed after 30 s idle + 3 probes 10 s apart
KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


def tune(sock: socket.socket) -> None:
    """No Nagle delay, and TCP keepalives, so a connection whose other end vanished (a home router
    that forgot it) is noticed within a minute or so instead of never."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in KEEPALIVE:
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def read_line(sock: socket.socket, timeout: float = GREETING_TIME) -> bytes:
    """One short line (no newline), read byte by byte so nothing after it is consumed; the whole
    line must arrive within ``timeout`` seconds (TimeoutError otherwise)."""
    deadline = time.monotonic() + timeout
    line = bytearray()
    while len(line) <= LINE_MAX:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete line in time")
        sock.settimeout(left)
        byte = sock.recv(1)
        if not byte or byte == b"\n":
            break
        line += byte
    sock.settimeout(None)
    return bytes(line)


def host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port)."""
    host, _, port = address.rpartition(":")
    return host, int(port)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: any free one); PortInUseError if taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise PortInUseError(f"port {port} on {host} is in use: give the relay another port") from None
    sock.listen(LISTEN_BACKLOG)
    return sock
