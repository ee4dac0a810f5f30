"""What a provider learns of its NAT before a task: its punching ports' public mappings, its UDP
engine's public address, and whether its NAT keeps one mapping per port (punching can work) or
makes a new one per destination (symmetric: it cannot).

A provider peers can dial needs none of this: its punching port is its own (``public_ports``). A
provider behind NAT asks its bootstrap's reflector (``channel.reflexive``), on the bootstrap's
host, at the relay's port and at the bootstrap's own port (two destinations tell the kinds of NAT
apart), through the bootstrap whose relay serves it.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field

from meshlearn.errors import BadMessage, NetworkError
from meshlearn.network.channel.punch import punch_socket
from meshlearn.network.channel.quicpath import PathCertificate
from meshlearn.network.channel.reflexive import NatKind, nat_kind, reflexive_address, tcp_reflexive_address
from meshlearn.network.protocol.providerapi import MAX_QUIC_PEERS, PunchPorts

log = logging.getLogger(__name__)
ASK_TIME = 3.0  # seconds the reflector may take to answer (asked again within, datagrams get lost)


def ipv4_of(host: str) -> str | None:
    """``host`` as an IPv4 address (resolved if a name); None where it has none."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


@dataclass
class QuicSockets:
    """A task run's side of the QUIC paths it may need: its certificate, and a bound UDP socket for
    the path with each other provider (by index), until a ``QuicPath`` takes it over."""

    certificate: PathCertificate = field(default_factory=PathCertificate.generate)
    sockets: dict[int, socket.socket] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def bind(cls, bind_host: str, peers: list[int]) -> QuicSockets:
        """One UDP socket per provider of ``peers`` (none beyond MAX_QUIC_PEERS: a larger task's links
        that TCP cannot punch go through the relay)."""
        made = cls()
        if len(peers) <= MAX_QUIC_PEERS:
            for index in peers:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((bind_host, 0))
                made.sockets[index] = sock
        return made

    def ports(self, public_port=lambda sock: sock.getsockname()[1]) -> dict[str, int]:
        """The public UDP port of each socket (``public_port``: as peers see it), by provider index."""
        return {str(index): public_port(sock) for index, sock in self.sockets.items()}

    def take(self, index: int) -> socket.socket | None:
        """The socket for the path with provider ``index``, now the caller's (None: there is none,
        or they were closed). Safe from any thread, against ``close`` too."""
        with self.lock:
            return self.sockets.pop(index, None)

    def close(self) -> None:
        with self.lock:
            closing, self.sockets = self.sockets, {}
        for sock in closing.values():
            sock.close()


@dataclass
class LinkSide:
    """What a task run's links need of this provider: its ``PunchPorts`` (None: it cannot punch),
    the TCP sockets that keep its punching ports, and its QUIC sockets and certificate."""

    ports: PunchPorts | None
    held: list[socket.socket] = field(default_factory=list)
    quic: QuicSockets = field(default_factory=QuicSockets)

    @property
    def here(self) -> tuple[int | None, int | None]:
        """The punching ports on this machine (out, in; None: not held), whose mappings ``ports`` names."""
        local = [sock.getsockname()[1] for sock in self.held]
        return (local[0] if local else None), (local[1] if len(local) > 1 else None)

    def close(self) -> None:
        for sock in self.held:
            sock.close()
        self.held = []
        self.quic.close()


def public_ports(bind_host: str, public_host: str, peers: list[int]) -> LinkSide:
    """A dialable provider's punching port (it punches towards providers behind NAT) and QUIC
    sockets; no ports where its public host is no IPv4 address."""
    host = ipv4_of(public_host)
    if host is None:
        return LinkSide(None)
    held = punch_socket(bind_host, 0)
    quic = QuicSockets.bind(bind_host, peers)
    return LinkSide(PunchPorts(host=host, out_port=held.getsockname()[1], quic_pin=quic.certificate.fingerprint.hex(),
                               udp_ports=quic.ports()), [held], quic)


@dataclass(frozen=True)
class NatSide:
    """A provider behind NAT: where its bootstrap's reflector answers (``host``, ``relay_port``:
    TCP and UDP; ``bootstrap_port``: UDP, the second destination)."""

    host: str
    relay_port: int
    bootstrap_port: int

    def symmetric(self, bind_host: str) -> bool:
        """Whether this machine's NAT maps each destination to a new port (asked with a fresh UDP
        socket); False where the reflector cannot say (a punch that then fails falls back)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((bind_host, 0))
            try:
                mapping = nat_kind(sock, sock.getsockname(),
                                   [(self.host, self.relay_port), (self.host, self.bootstrap_port)])
            except NetworkError as exc:
                log.info("could not learn this machine's kind of NAT: %s", exc)
                return False
        return mapping.kind is NatKind.SYMMETRIC

    def punch_ports(self, bind_host: str, peers: list[int]) -> LinkSide:
        """This provider's two punching ports and its QUIC sockets (one per provider of ``peers``)
        with their public mappings; no ports behind a symmetric NAT, or where the reflector does
        not answer."""
        if self.symmetric(bind_host):
            log.warning("this machine is behind a NAT that maps each destination to a new port: its task links "
                        "to providers behind NAT go through the relay")
            return LinkSide(PunchPorts(behind_nat=True))
        side = LinkSide(None, [punch_socket(bind_host, 0), punch_socket(bind_host, 0)], QuicSockets.bind(bind_host, peers))
        try:
            (host, out_port), (_, in_port) = (
                tcp_reflexive_address(sock.getsockname()[1], (self.host, self.relay_port), ASK_TIME,
                                      local_host=bind_host) for sock in side.held)
        except NetworkError as exc:
            log.info("could not learn this machine's public ports: %s", exc)
            side.close()
            return LinkSide(PunchPorts(behind_nat=True))
        try:  # UDP blocked towards the reflector costs the QUIC paths only
            quic = {"quic_pin": side.quic.certificate.fingerprint.hex(),
                    "udp_ports": side.quic.ports(lambda sock: reflexive_address(sock, (self.host, self.relay_port),
                                                                                ASK_TIME)[1])}
        except NetworkError as exc:
            log.info("could not learn this machine's public UDP ports (no QUIC paths): %s", exc)
            side.quic.close()
            quic = {}
        side.ports = PunchPorts(host=host, out_port=out_port, in_port=in_port, behind_nat=True, **quic)
        return side

    def udp_engine_address(self, sock: socket.socket) -> str:
        """Where peers reach the UDP engine bound to ``sock``: its NAT's mapping of that socket, as
        the reflector saw it; BadMessage where that mapping is not one peers can use (a symmetric
        NAT), or cannot be learned."""
        local = sock.getsockname()
        try:
            mapping = nat_kind(sock, local, [(self.host, self.relay_port), (self.host, self.bootstrap_port)])
        except NetworkError as exc:
            raise BadMessage(f"this provider is behind NAT and could not learn its UDP engine's public address "
                             f"({exc}): ask with --transport tcp") from None
        if mapping.kind is NatKind.SYMMETRIC:
            raise BadMessage("this provider is behind a NAT that maps each destination to a new port, which UDP "
                             "datagrams cannot cross: ask with --transport tcp (its links then go through the "
                             "relay), or run providers behind other NATs")
        host, port = mapping.address
        return f"{host}:{port}"

