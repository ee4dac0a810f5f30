"""Reflexive addresses: the public address and port a peer's NAT gives one of its sockets, as the
bootstrap sees it (STUN's idea, with the bootstrap as the server and a format of its own).

A peer sends a request datagram from the socket it will punch from; the bootstrap's ``Reflector``
(reflector.py) answers with the address and port the request came from. Asked from one socket at two ports of the
bootstrap, the two answers say whether the NAT keeps one mapping per socket whatever the
destination (``cone``: punching can work), makes one per destination (``symmetric``: it cannot), or
is not there at all (``open``). Over TCP the relay's agent port answers ``ADDR`` the same way.

Datagrams (IPv4 only: a reply carries a 4-byte address), all DATAGRAM_SIZE bytes, padding zero::

    request  MLRX | version u8 | kind u8 = 1 | nonce 16 bytes | zero padding
    reply    MLRX | version u8 | kind u8 = 2 | the request's nonce | IPv4 4 bytes | port u16 | zero padding

A reply is never larger than its request, so a stranger who forges a victim's source address gets
no amplification, and the reflector answers at most ``rate`` requests a second in all, so a flood
costs it bounded work. It keeps nothing per sender. Answers are not authenticated: someone on the
path can lie about a mapping, which makes a punch fail (and the pair use the relay), nothing more.
"""

from __future__ import annotations

import ipaddress
import os
import select
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import NetworkError, Unreachable, WireError
from meshlearn.network.channel.addresses import is_wildcard, source_address_toward
from meshlearn.network.channel.punch import punch_socket
from meshlearn.network.channel.relaywire import (
    ADDR_REPLY,
    ADDR_REQUEST,
    LINE_MAX,
    host_port,
    read_line,
)

MAGIC = b"MLRX"
VERSION = 1
REQUEST, REPLY = 1, 2  # datagram kinds
NONCE_SIZE = 16  # random bytes a reply must echo: a forger off the path cannot guess them
_HEADER = struct.Struct("!4sBB16s")
_ADDRESS = struct.Struct("!4sH")
DATAGRAM_SIZE = 32  # both kinds (a reply needs 28): a reply is never larger than the request it answers
ASK_TIME = 3.0  # seconds a client waits for its answer
SENDS = 5  # requests a client sends in that time, evenly spaced (datagrams get lost)
EOF_TIME = 1.0  # seconds tcp_reflexive_address waits for the relay to close first (its TIME_WAIT, not ours)


class BadReflexive(WireError):
    """A reflexive-address datagram that cannot be decoded: wrong size, magic, version, kind or padding."""


def encode_request(nonce: bytes) -> bytes:
    """A request carrying ``nonce`` (NONCE_SIZE random bytes), padded to DATAGRAM_SIZE."""
    _check_nonce(nonce)
    return _HEADER.pack(MAGIC, VERSION, REQUEST, nonce).ljust(DATAGRAM_SIZE, b"\0")


def encode_reply(nonce: bytes, address: tuple[str, int]) -> bytes:
    """A reply to the request carrying ``nonce``: it came from ``address`` (IPv4 host, port)."""
    _check_nonce(nonce)
    host, port = address
    body = _HEADER.pack(MAGIC, VERSION, REPLY, nonce) + _ADDRESS.pack(socket.inet_aton(host), port)
    return body.ljust(DATAGRAM_SIZE, b"\0")


def decode_request(data: bytes) -> bytes:
    """The nonce of a request; BadReflexive if ``data`` is not one."""
    nonce = _decode_header(data, REQUEST)
    _check_padding(data, _HEADER.size)
    return nonce


def decode_reply(data: bytes) -> tuple[bytes, tuple[str, int]]:
    """(nonce, (host, port)) of a reply; BadReflexive if ``data`` is not one."""
    nonce = _decode_header(data, REPLY)
    packed, port = _ADDRESS.unpack_from(data, _HEADER.size)
    _check_padding(data, _HEADER.size + _ADDRESS.size)
    if port == 0:
        raise BadReflexive("reflexive reply names port 0")
    return nonce, (socket.inet_ntoa(packed), port)


def _decode_header(data: bytes, kind: int) -> bytes:
    if len(data) != DATAGRAM_SIZE:
        raise BadReflexive(f"reflexive datagram of {len(data)} bytes (expected {DATAGRAM_SIZE})")
    magic, version, got, nonce = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadReflexive("not a reflexive-address datagram (bad magic)")
    if version != VERSION:
        raise BadReflexive(f"reflexive datagram of version {version} (this side speaks {VERSION}): upgrade one side")
    if got != kind:
        raise BadReflexive(f"reflexive datagram of kind {got} (expected {kind})")
    return nonce


def _check_nonce(nonce: bytes) -> None:
    if len(nonce) != NONCE_SIZE:
        raise ValueError(f"a reflexive nonce is {NONCE_SIZE} bytes, not {len(nonce)}")


def _check_padding(data: bytes, start: int) -> None:
    if any(data[start:]):
        raise BadReflexive("reflexive datagram with non-zero padding")


def reflexive_address(sock: socket.socket, server: tuple[str, int], timeout: float = ASK_TIME,
                      clock: Clock = SYSTEM) -> tuple[str, int]:
    """The public (host, port) of ``sock`` (UDP, bound) as the reflector at ``server`` sees it.
    Sends SENDS requests over ``timeout`` seconds (the same nonce: a late answer to any counts) and
    takes the first reply that echoes the nonce. ``sock`` may be non-blocking and is left as it
    was, but every other datagram that reaches it meanwhile is read and dropped: ask before the
    socket's own user starts reading it. Unreachable when no answer comes."""
    nonce = os.urandom(NONCE_SIZE)
    request = encode_request(nonce)
    start = clock.monotonic()
    for sent in range(SENDS):
        _send(sock, request, server)
        until = start + timeout * (sent + 1) / SENDS
        while (left := until - clock.monotonic()) > 0:
            if not select.select([sock], [], [], left)[0]:
                continue
            reply = _receive(sock)
            if reply is not None and reply[0] == nonce:
                return reply[1]
    raise Unreachable(f"no answer from the bootstrap at {server[0]}:{server[1]} (UDP) in {timeout:g} s: is it "
                      f"running, and does this network let UDP through to it?")


def _send(sock: socket.socket, request: bytes, server: tuple[str, int]) -> None:
    try:
        sock.sendto(request, server)
    except BlockingIOError:  # the send buffer is full: the next try goes
        pass
    except OSError as exc:
        raise Unreachable(f"cannot send to the bootstrap at {server[0]}:{server[1]} (UDP): "
                          f"{(exc.strerror or str(exc)).lower()}") from None


def _receive(sock: socket.socket) -> tuple[bytes, tuple[str, int]] | None:
    """One datagram off ``sock`` without blocking, decoded as a reply; None if it is not one."""
    try:
        data, _ = sock.recvfrom(DATAGRAM_SIZE + 1, getattr(socket, "MSG_DONTWAIT", 0))
        return decode_reply(data)
    except (OSError, BadReflexive):  # nothing after all, a queued ICMP error, or someone else's datagram
        return None


class NatKind(Enum):
    """How a NAT maps one socket's flows: not at all, one mapping whatever the destination, or one per destination."""

    OPEN = "open"
    CONE = "cone"
    SYMMETRIC = "symmetric"


@dataclass(frozen=True)
class NatMapping:
    """What ``nat_kind`` learned: the NAT's kind, and the socket's public (host, port) seen by the first server."""

    kind: NatKind
    address: tuple[str, int]


def classify(local: tuple[str, int], first: tuple[str, int], second: tuple[str, int]) -> NatMapping:
    """The NAT's kind from the socket's own address and the two reflexive answers: the same answer
    at both ports, ``open`` where it is the local address (no NAT) and ``cone`` otherwise;
    different answers, ``symmetric``."""
    if first != second:
        return NatMapping(NatKind.SYMMETRIC, first)
    return NatMapping(NatKind.OPEN if first == local else NatKind.CONE, first)


def nat_kind(sock: socket.socket, local: tuple[str, int], servers: Sequence[tuple[str, int]],
             timeout: float = ASK_TIME, clock: Clock = SYSTEM) -> NatMapping:
    """Ask both ``servers`` (the bootstrap's two ports) from ``sock``, bound at ``local`` (a
    wildcard host there stands for this machine's address toward the first server), and classify."""
    first, second = (reflexive_address(sock, server, timeout, clock) for server in servers)
    if is_wildcard(local[0]):
        local = (source_address_toward(servers[0][0], servers[0][1]) or local[0], local[1])
    return classify(local, first, second)


def tcp_reflexive_address(local_port: int, server: tuple[str, int], timeout: float = ASK_TIME,
                          local_host: str = "0.0.0.0") -> tuple[str, int]:
    """The public (host, port) of TCP connections from ``local_port``, as the relay's agent port at
    ``server`` sees them (``ADDR``). The socket shares its port (SO_REUSEADDR, SO_REUSEPORT), so
    the port can be bound again for punching at once; the relay closes first, so the closed
    connection's TIME_WAIT stays there. Unreachable or NetworkError, in one line, on failure."""
    where = f"{server[0]}:{server[1]}"
    deadline = time.monotonic() + timeout
    try:
        with punch_socket(local_host, local_port) as sock:
            sock.settimeout(timeout)
            sock.connect(server)
            sock.sendall(ADDR_REQUEST + b"\n")
            line = read_line(sock, max(0.0, deadline - time.monotonic()))
            _wait_for_close(sock)
    except OSError as exc:
        raise Unreachable(f"cannot ask the relay at {where} for this port's public address: "
                          f"{(exc.strerror or str(exc) or type(exc).__name__).lower()}") from None
    return _parse_address(line, where)


def _wait_for_close(sock: socket.socket) -> None:
    """Read until the other side closes (EOF_TIME and LINE_MAX bytes at most): it then holds the TIME_WAIT."""
    deadline = time.monotonic() + EOF_TIME
    left = LINE_MAX
    try:
        while left > 0 and (wait := deadline - time.monotonic()) > 0:
            sock.settimeout(wait)
            data = sock.recv(left)
            if not data:
                return
            left -= len(data)
    except OSError:
        pass


def _parse_address(line: bytes, where: str) -> tuple[str, int]:
    """``meshlearn-addr HOST:PORT`` as (host, port); NetworkError if the line is anything else."""
    text = line[len(ADDR_REPLY):].decode("ascii", "replace") if line.startswith(ADDR_REPLY) else ""
    try:
        host, port = host_port(text.strip())
        if 0 < port < 65536:
            return str(ipaddress.IPv4Address(host)), port
    except ValueError:  # no port, or no IPv4 address
        pass
    raise NetworkError(f"the relay at {where} did not announce an address (is it a meshlearn bootstrap's relay "
                       f"port?)")
