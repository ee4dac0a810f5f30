"""The bootstrap's side of reflexive addresses (reflexive.py): a ``Reflector`` answers each request
datagram with the address and port it came from, on one or more UDP ports, from one thread.

Anyone can send to it, so it keeps nothing per sender, answers no more than it was sent (a reply is
the request's size: a forged source address gains a flood nothing) and at most ``rate`` replies a
second in all (a token bucket); the rest is dropped and counted, with sparse warnings.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import sys

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import NetworkError, PortInUseError
from meshlearn.network.channel.reflexive import (
    DATAGRAM_SIZE,
    BadReflexive,
    decode_request,
    encode_reply,
)
from meshlearn.network.channel.splicer import READ, Loop
from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)

RATE = 1000.0  # requests the reflector answers a second at most, in all (32 KB/s of replies)
BURST = 100  # ... and at once after a quiet moment (the token bucket's size)
BATCH = 64  # datagrams read from one socket per wake-up: one busy port cannot starve the other


# Linux's IP_PKTINFO (Python names it from 3.14): each request's destination address, so that a
# reflector bound to every interface answers from the address it was asked at (else the kernel picks
# one by route, and on a machine with several the client's NAT drops an answer from another address)
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8 if sys.platform.startswith("linux") else None)
_PKTINFO = struct.Struct("=i4s4s")  # struct in_pktinfo: interface index, local address, destination address
_ANCILLARY_SPACE = socket.CMSG_SPACE(_PKTINFO.size) if IP_PKTINFO is not None else 0


def answer(datagram: bytes, source: tuple) -> bytes | None:
    """The reflector's whole job for one datagram, without sockets: the reply to a valid request
    that came from ``source`` (an IPv4 (host, port)), or None for anything else (dropped)."""
    try:
        nonce = decode_request(datagram)
        return encode_reply(nonce, (source[0], source[1]))
    except (BadReflexive, OSError, struct.error, IndexError, TypeError):  # not a request, or not IPv4
        return None


class ReplyBudget:
    """A token bucket: ``take()`` says whether one more reply fits in ``rate`` a second (``burst`` at once)."""

    def __init__(self, rate: float = RATE, burst: int = BURST, clock: Clock = SYSTEM):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._tokens = float(burst)
        self._last = clock.monotonic()

    def take(self) -> bool:
        now = self.clock.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class Reflector:
    """Answers reflexive-address requests on one or more UDP ports (``bind`` each, then ``start``;
    ``stop``), all from one thread. Counters: ``answered``, ``invalid`` (not a request: dropped),
    ``limited`` (over the rate: dropped)."""

    def __init__(self, host: str, rate: float = RATE, burst: int = BURST, clock: Clock = SYSTEM):
        self.host = host
        self.budget = ReplyBudget(rate, burst, clock)
        self.sockets: list[socket.socket] = []
        self.answered = self.invalid = self.limited = 0
        self._loop = Loop("reflector", on_stop=self._close)
        self._warn = SparseLog(log)

    def bind(self, port: int, required: bool = True) -> int | None:
        """Serve UDP on ``port`` too (0: any free one); the port. A port taken raises PortInUseError,
        unless not ``required`` (its owner chose a free TCP port: its UDP twin may be taken): then
        it is skipped, with a warning, and None returned."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind((self.host, port))
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise NetworkError(f"cannot serve UDP on {self.host}:{port}: {exc.strerror or exc}") from None
            if required:
                raise PortInUseError(f"UDP port {port} on {self.host} is in use (reflexive addresses are "
                                     f"answered on the bootstrap's and its relay's port numbers): free it "
                                     f"or choose another port") from None
            log.warning("reflexive addresses are not served on UDP port %d: it is in use", port)
            return None
        sock.setblocking(False)
        if IP_PKTINFO is not None:
            sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        self.sockets.append(sock)
        return sock.getsockname()[1]

    def start(self) -> None:
        """Serve, in the reflector's thread."""
        self._loop.start()
        self._loop.call_soon(self._begin)

    def stop(self) -> None:
        """Stop serving and close the sockets (back when this returns)."""
        self._loop.stop()

    def _begin(self) -> None:
        for sock in self.sockets:
            self._loop.watch(sock, READ, lambda mask, sock=sock: self._readable(sock))

    def _readable(self, sock: socket.socket) -> None:
        for _ in range(BATCH):
            try:  # one byte more than a request: an oversized one shows
                datagram, ancillary, _, source = sock.recvmsg(DATAGRAM_SIZE + 1, _ANCILLARY_SPACE)
            except BlockingIOError:
                return
            except OSError:  # an ICMP error of an earlier reply, queued on the socket: nothing to do
                continue
            self._serve(sock, datagram, source, _from_where_it_came(ancillary))

    def _serve(self, sock: socket.socket, datagram: bytes, source: tuple, ancillary: list) -> None:
        reply = answer(datagram, source)
        if reply is None:
            self.invalid += 1
            self._warn.warning("invalid", "reflector: dropped a datagram that is no reflexive-address request")
        elif not self.budget.take():
            self.limited += 1
            self._warn.warning("limited", "reflector: over %g answers a second, dropped a request", self.budget.rate)
        else:
            try:
                sock.sendmsg([reply], ancillary, 0, source)
                self.answered += 1
            except OSError:  # the send buffer is full, or no route back: the client asks again
                pass

    def _close(self) -> None:
        for sock in self.sockets:
            sock.close()


def _from_where_it_came(ancillary: list) -> list:
    """What makes a reply leave from the address its request came to (IP_PKTINFO), or nothing."""
    for level, kind, data in ancillary:
        if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(data) >= _PKTINFO.size:
            _, _, destination = _PKTINFO.unpack_from(data)
            return [(socket.IPPROTO_IP, IP_PKTINFO, _PKTINFO.pack(0, destination, bytes(4)))]
    return []
