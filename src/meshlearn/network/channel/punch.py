"""Direct paths through NATs: both ends connect to each other at once (a TCP simultaneous open).

Two peers behind NATs cannot accept each other's connections, but each NAT lets in what answers a
flow its own side opened. So each peer binds a port whose public mapping it learned from the
bootstrap (``reflexive``), and connects from it to the other's mapping, both sides at about the
same time (the requester's start reaches them within a moment). The first SYN to leave opens its
sender's NAT and is dropped by the other's; the other's SYN then finds the first's mapping open
and reaches its socket, still connecting, and TCP's simultaneous open joins the two (RFC 793,
and what libp2p's DCUtR and Tailscale do over UDP). A SYN that finds its peer not yet connecting
may be refused (a reset): this side connects again a moment later, until a deadline.

Behind a NAT that maps each destination to a new port (symmetric), the learned mapping is not the
one the peer meets, and punching cannot work: the caller does not try (``reflexive.nat_kind``),
and a punch that fails is remembered (``PunchMemory``) so the pair goes straight to the relay for a
while, then tries again.

Where TCP cannot be punched (a firewall that drops every SYN from outside), ``punch_udp`` opens a
UDP path the same way (each side sends until it hears the other) for QUIC to run on (quicpath.py).

Everything here is blocking and thread-free; ``clock`` and ``connect`` are injectable, so the
retry rule is tested with a fake clock and sockets on loopback.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshlearn.clock import SYSTEM, Clock

PUNCH_TIME = 8.0  # seconds a pair keeps trying before its link falls back to the relay
ATTEMPT_TIME = 1.5  # seconds one connect waits: a SYN the peer's NAT dropped is sent again by the kernel after 1 s
REFUSED_PAUSE = 0.05  # seconds before connecting again after a reset (the peer was not connecting yet)
RETRY_AFTER = 600.0  # seconds a pair whose punch failed goes straight to the relay before punching again
UDP_PUNCH_TIME = 12.0  # seconds a UDP punch keeps trying: a peer that still tries TCP joins within PUNCH_TIME
UDP_EVERY = 0.05  # seconds between a UDP punch's datagrams
PUNCH_TOKEN = b"meshlearn-punch\x01"  # what each end of a punched TCP connection sends the other (``confirm``)
PUNCH_DONE = b"\x02"  # what the outward end sends once it read the other's token (``confirm``)
CONFIRM_TIME = 2.0  # seconds an end waits for the other's token
UDP_AFTER = 3  # datagrams sent once the peer was heard (the first ones may have met a NAT not yet open)
PUNCH_DATAGRAM = b"\x00meshlearn-punch"  # what a UDP punch sends: its first byte's QUIC fixed bit is clear, so
# a QUIC endpoint that reads one discards it (RFC 9000, 17.2 and 17.3)
# errors that say "not yet" (a reset, a port of ours still held a moment): connect again after a pause
_NOT_YET = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EHOSTUNREACH,
            errno.ENETUNREACH}


def punch_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that shares the port with the others punching from it
    (one local port serves a link to each peer: the peers' addresses tell the connections apart)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def connect_once(local: tuple[str, int], peer: tuple[str, int], timeout: float) -> socket.socket:
    """One connect from ``local`` to ``peer`` within ``timeout`` seconds: the connected socket
    (blocking), or the OSError that ended the try."""
    sock = punch_socket(*local)
    try:
        sock.settimeout(timeout)
        sock.connect(peer)
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def confirm(sock: socket.socket, outward: bool, timeout: float = CONFIRM_TIME) -> bool:
    """Whether the other end of a punched connection is a meshlearn punch that holds it too, and
    both ends agree to let it go for their engines to connect between the same ports: each end
    sends PUNCH_TOKEN and reads the other's; then the ``outward`` end (the one whose engine will
    dial) sends PUNCH_DONE, and the inward end, once it read that, resets the connection, which the
    outward end waits for. So no end resets before the other read what it needs (a reset drops
    what its receiver has not read yet). A stranger's listener that happened to answer the SYN
    sends something else, or nothing; within ``timeout`` seconds, or False. The inward end's
    socket is closed when it returns True."""
    deadline = time.monotonic() + timeout
    token_read = False
    try:
        sock.sendall(PUNCH_TOKEN)
        token_read = _read(sock, len(PUNCH_TOKEN), deadline) == PUNCH_TOKEN
        if not token_read:
            return False
        if not outward:
            if _read(sock, len(PUNCH_DONE), deadline) != PUNCH_DONE:
                return False
            reset_close(sock)
            return True
        sock.sendall(PUNCH_DONE)
        _read(sock, 1, deadline)  # the inward end's reset ends it (EOF or anything else: it did not agree)
        return False
    except ConnectionResetError:
        return outward and token_read
    except OSError:
        return False


def _read(sock: socket.socket, count: int, deadline: float) -> bytes:
    """Up to ``count`` bytes from ``sock`` by ``deadline`` (fewer at its end); TimeoutError after."""
    got = b""
    while len(got) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the other end of the punch said nothing in time")
        sock.settimeout(left)
        chunk = sock.recv(count - len(got))
        if not chunk:
            break
        got += chunk
    return got


def reset_close(sock: socket.socket) -> None:
    """Close a punched connection with a reset (no FIN, no TIME_WAIT): its two ports are free at once
    for the engine to connect between them again, through the NAT mappings the punch opened."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def engine_path(source: tuple[str, int], target: tuple[str, int]) -> str:
    """ZeroMQ's address for a connection from ``source`` to ``target`` (``tcp://SOURCE;TARGET``):
    how an engine dials a neighbour over a punched path, from the port the punch went from."""
    return f"tcp://{source[0]}:{source[1]};{target[0]}:{target[1]}"


@dataclass
class PunchResult:
    """How a punch ended: the connected socket (None where it failed), the tries and why the last failed."""

    sock: socket.socket | None
    tries: int
    why: str = ""


def punch_tcp(local: tuple[str, int], peer: tuple[str, int], deadline: float, clock: Clock = SYSTEM,
              connect: Callable[[tuple[str, int], tuple[str, int], float], socket.socket] = connect_once,
              cancelled: threading.Event | None = None) -> PunchResult:
    """Connect from ``local`` to ``peer`` (its NAT's mapping) until it works or ``deadline``
    (``clock.monotonic()``) passes, or ``cancelled`` is set; the peer does the same towards us."""
    tries, why = 0, "no time to try"
    while not (cancelled is not None and cancelled.is_set()):
        left = deadline - clock.monotonic()
        if left <= 0:
            break
        tries += 1
        try:
            return PunchResult(connect(local, peer, min(ATTEMPT_TIME, left)), tries)
        except TimeoutError:
            why = "timed out"  # our SYN met a NAT not yet open: a new socket sends a new one at once
        except OSError as exc:
            if exc.errno not in _NOT_YET:
                return PunchResult(None, tries, (exc.strerror or str(exc)).lower())
            why = (exc.strerror or str(exc)).lower()
            clock.sleep(REFUSED_PAUSE)
    return PunchResult(None, tries, why)


def punch_udp(sock: socket.socket, peer: tuple[str, int], deadline: float, clock: Clock = SYSTEM,
              cancelled: threading.Event | None = None) -> bool:
    """Open a UDP path from ``sock`` to ``peer`` (its NAT's mapping) through both NATs: send a small
    datagram every UDP_EVERY seconds until one comes back from the peer (its own, or already its
    QUIC handshake, which is left in the socket for QUIC to read), then a few more so the peer hears
    this side too; False if nothing came before ``deadline``. Datagrams from anyone else are dropped."""
    while not (cancelled is not None and cancelled.is_set()) and clock.monotonic() < deadline:
        try:
            sock.sendto(PUNCH_DATAGRAM, peer)
        except OSError:
            pass  # an ICMP error of an earlier datagram, or no route yet: try again
        if _heard(sock, peer):
            for _ in range(UDP_AFTER):
                with contextlib.suppress(OSError):
                    sock.sendto(PUNCH_DATAGRAM, peer)
            return True
        clock.sleep(UDP_EVERY)
    return False


def _heard(sock: socket.socket, peer: tuple[str, int]) -> bool:
    """Whether a datagram from ``peer`` waits in ``sock`` (ours consumed, the peer's QUIC left);
    drops those of anyone else."""
    while True:
        try:
            data, source = sock.recvfrom(len(PUNCH_DATAGRAM) + 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # a queued ICMP error (the peer's NAT not open yet): take it off and look again
            with contextlib.suppress(OSError):
                sock.recvfrom(1, socket.MSG_DONTWAIT)
            continue
        if source[:2] != peer or data == PUNCH_DATAGRAM:
            with contextlib.suppress(OSError):
                sock.recvfrom(len(PUNCH_DATAGRAM) + 1, socket.MSG_DONTWAIT)
        if source[:2] == peer:
            return True


class PunchMemory:
    """Which peers a punch failed with lately (by key, and kind: "tcp" or "quic"), so their links
    skip it without waiting for it to fail again; each is tried again ``retry_after`` seconds after
    it failed."""

    def __init__(self, clock: Clock = SYSTEM, retry_after: float = RETRY_AFTER):
        self.clock = clock
        self.retry_after = retry_after
        self._failed: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def worth_trying(self, peer: str, kind: str = "tcp") -> bool:
        """Whether to punch towards ``peer`` over ``kind`` now."""
        with self._lock:
            failed_at = self._failed.get((peer, kind))
            if failed_at is not None and self.clock.monotonic() - failed_at >= self.retry_after:
                del self._failed[(peer, kind)]
                failed_at = None
            return failed_at is None

    def failed(self, peer: str, kind: str = "tcp") -> None:
        """A punch towards ``peer`` over ``kind`` failed just now."""
        with self._lock:
            self._failed[(peer, kind)] = self.clock.monotonic()

    def worked(self, peer: str, kind: str = "tcp") -> None:
        """A punch towards ``peer`` over ``kind`` worked: forget an earlier failure."""
        with self._lock:
            self._failed.pop((peer, kind), None)
