"""The QUIC path on loopback: two sides, each on its own UDP socket, carrying real ZeroMQ and TCP
connections; pinning refused both ways; the end of one side ending the other's; nothing left over."""

from __future__ import annotations

import concurrent.futures
import os
import select
import socket
import threading

import pytest
import zmq
from helpers.waiting import wait_until

from meshlearn.errors import KeyMismatch, NetworkError
from meshlearn.network.channel.quicconn import STREAM_WINDOW, matches_pin
from meshlearn.network.channel.quicpath import (
    PathCertificate,
    QuicHandshakeTimeout,
    QuicPath,
    QuicPathError,
    QuicPinMismatch,
    role_for,
)
from meshlearn.network.channel.quicstreams import CHUNK, MAX_STREAMS, SEND_BACKLOG

WAIT = 30.0  # seconds a test waits for what must happen (generous: the machine is shared)
BIG = 10_000_000  # bytes of the large message


def _udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def _path_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "quic-path"]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Pair:
    """A client and a server side of one path over two loopback UDP sockets, not started."""

    def __init__(self, client_pin: bytes | None = None, server_pin: bytes | None = None, **times):
        self.sockets = _udp(), _udp()
        client_cert, server_cert = PathCertificate.generate(), PathCertificate.generate()
        self.client = QuicPath(self.sockets[0], self.sockets[1].getsockname(), "client", client_cert,
                               client_pin or server_cert.fingerprint, **times)
        self.server = QuicPath(self.sockets[1], self.sockets[0].getsockname(), "server", server_cert,
                               server_pin or client_cert.fingerprint, **times)

    def start(self) -> list[BaseException | None]:
        """Start both sides at once; what each raised (None: it started)."""
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = [pool.submit(side.start) for side in (self.client, self.server)]
            return [future.exception() for future in started]

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def pairs():
    """Makes Pairs; every one is closed when the test ends, passed or not."""
    made: list[Pair] = []

    def make(**kwargs) -> Pair:
        made.append(Pair(**kwargs))
        return made[-1]
    yield make
    for pair in made:
        pair.close()


@pytest.fixture
def zsocket():
    """Makes ZeroMQ sockets (``zsocket(zmq.ROUTER)``) that give up after WAIT; all closed at the end."""
    ctx = zmq.Context()
    made: list[zmq.Socket] = []

    def make(kind: int) -> zmq.Socket:
        made.append(ctx.socket(kind))
        made[-1].setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
        made[-1].setsockopt(zmq.LINGER, 0)
        return made[-1]
    yield make
    for sock in made:
        sock.close()
    ctx.term()


def test_zeromq_dealer_to_router_both_ways_over_the_path(pairs, zsocket):
    pair = pairs()
    routers = [zsocket(zmq.ROUTER) for _ in range(2)]
    ports = [router.bind_to_random_port("tcp://127.0.0.1") for router in routers]
    # each side exposes its own engine (ROUTER) and gets the port that reaches the other's
    local = [pair.client.expose_local(ports[0]), pair.server.expose_local(ports[1])]
    assert pair.start() == [None, None]
    dealers = [zsocket(zmq.DEALER) for _ in range(2)]
    for dealer, port in zip(dealers, local):
        dealer.connect(f"tcp://127.0.0.1:{port}")
    big = os.urandom(BIG)
    # the client's dealer reaches the server's router, and the server's dealer the client's
    for dealer, router in ((dealers[0], routers[1]), (dealers[1], routers[0])):
        for n in range(3):
            dealer.send(f"hello {n}".encode())
            sender, message = router.recv_multipart()
            assert message == f"hello {n}".encode()
            router.send_multipart([sender, b"reply %d" % n])
            assert dealer.recv() == b"reply %d" % n
        dealer.send(big)
        sender, message = router.recv_multipart()
        assert message == big
        router.send_multipart([sender, big[::-1]])
        assert dealer.recv() == big[::-1]
    for side in (pair.client, pair.server):  # a side counts what it received as its loop gets to it
        assert wait_until(lambda: side.sent_bytes > 2 * BIG and side.received_bytes > 2 * BIG), \
            (side.sent_bytes, side.received_bytes)
        assert side.why == "" and not side.ended.is_set()


@pytest.mark.parametrize("wrong", ["client", "server"])
def test_a_certificate_that_is_not_the_pinned_one_is_refused(pairs, wrong):
    other_fingerprint = PathCertificate.generate().fingerprint
    pair = pairs(**{f"{wrong}_pin": other_fingerprint})
    client_error, server_error = pair.start()
    refusing, refused = (client_error, server_error) if wrong == "client" else (server_error, client_error)
    assert isinstance(refusing, QuicPinMismatch) and isinstance(refusing, KeyMismatch)
    assert "not the one pinned" in str(refusing) and "\n" not in str(refusing)
    assert isinstance(refused, QuicPathError) and not isinstance(refused, QuicHandshakeTimeout)
    assert "refused this side's certificate" in str(refused)  # told (or, in the handshake, guessed)
    assert wait_until(lambda: not _path_threads(), WAIT)
    assert all(sock.fileno() == -1 for sock in pair.sockets)


def test_a_peer_that_never_answers_is_a_handshake_timeout(pairs):
    silent = _udp()
    try:
        path = QuicPath(_udp(), silent.getsockname(), "client", PathCertificate.generate(),
                        PathCertificate.generate().fingerprint, handshake_timeout=0.5)
        with pytest.raises(QuicHandshakeTimeout, match="no QUIC handshake with 127.0.0.1:"):
            path.start()
        assert not _path_threads() and path.ended.is_set()
    finally:
        silent.close()


def test_closing_one_side_ends_the_other_sides_connections_and_leaves_nothing(pairs):
    before = _open_fds()
    engine = socket.create_server(("127.0.0.1", 0))
    engine.settimeout(WAIT)
    pair = pairs()
    client_port = pair.client.expose_local(None)
    server_port = pair.server.expose_local(engine.getsockname()[1])
    assert pair.start() == [None, None]
    dealer = socket.create_connection(("127.0.0.1", client_port), timeout=WAIT)
    dealer.sendall(b"ping")
    carried, _ = engine.accept()
    carried.settimeout(WAIT)
    assert carried.recv(4) == b"ping"
    carried.sendall(b"pong")
    assert dealer.recv(4) == b"pong"

    pair.client.close()
    assert _reads_end(carried) and _reads_end(dealer)
    assert pair.server.ended.wait(WAIT)
    assert "the peer closed the path" in pair.server.why
    pair.server.close()
    assert not _path_threads()
    assert all(sock.fileno() == -1 for sock in pair.sockets)
    for port in (client_port, server_port):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=WAIT).close()
    for sock in (dealer, carried, engine):
        sock.close()
    assert _open_fds() == before


def _reads_end(sock: socket.socket) -> bool:
    """Whether the connection ends (closed or reset by the other end) before WAIT."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_at_most_max_streams_connections_are_carried_at_once(pairs):
    engine = socket.create_server(("127.0.0.1", 0), backlog=2 * MAX_STREAMS)
    engine.settimeout(WAIT)
    pair = pairs()
    port = pair.client.expose_local(None)
    pair.server.expose_local(engine.getsockname()[1])
    assert pair.start() == [None, None]
    dealers, carried = [], []
    try:
        for n in range(MAX_STREAMS + 2):
            if n == MAX_STREAMS + 1:  # one of the carried ends, both ways: its place is free again
                dealers[0].shutdown(socket.SHUT_WR)
                assert _reads_end(carried[0])
                carried[0].close()
                assert _reads_end(dealers[0])
            dealers.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT))
            dealers[-1].sendall(b"%d" % n)
            if n == MAX_STREAMS:  # one too many: closed at once, never carried
                assert _reads_end(dealers[-1])
                continue
            carried.append(engine.accept()[0])
            carried[-1].settimeout(WAIT)
            assert carried[-1].recv(8) == b"%d" % n
    finally:
        for sock in dealers + carried + [engine]:
            sock.close()


def test_keepalives_hold_an_idle_path_open_past_its_idle_timeout(pairs):
    engine = socket.create_server(("127.0.0.1", 0))
    engine.settimeout(WAIT)
    pair = pairs(keepalive=0.1, idle_timeout=1.0)
    port = pair.client.expose_local(None)
    pair.server.expose_local(engine.getsockname()[1])
    assert pair.start() == [None, None]
    # 15 pings acknowledged, one each 0.1 s: the path stayed idle (no stream) longer than its idle timeout
    assert wait_until(lambda: pair.client.keepalives >= 15 or pair.client.ended.is_set(), WAIT)
    assert not pair.client.ended.is_set() and not pair.server.ended.is_set()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as dealer:
        dealer.sendall(b"still there")
        carried, _ = engine.accept()
        with carried:
            carried.settimeout(WAIT)
            assert carried.recv(11) == b"still there"
    engine.close()


def test_without_keepalives_an_idle_path_ends(pairs):
    pair = pairs(keepalive=60.0, idle_timeout=0.5)
    assert pair.start() == [None, None]
    assert pair.client.ended.wait(WAIT) and pair.server.ended.wait(WAIT)
    assert wait_until(lambda: not _path_threads(), WAIT)
    assert "no packet from the peer for 0.5 s" in pair.client.why


def test_a_reader_that_stops_holds_the_sender_back_within_the_bounds(pairs):
    """The engine stops reading: the path's windows fill and the sender's connection stops taking
    bytes, with what the two sides hold bounded; then everything arrives, in order."""
    total = 48_000_000
    small = 1 << 16  # kernel buffers at both ends: the path's own bounds are what is measured
    engine = socket.socket()
    engine.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, small)
    engine.bind(("127.0.0.1", 0))
    engine.listen()
    engine.settimeout(WAIT)
    pair = pairs()
    port = pair.client.expose_local(None)
    pair.server.expose_local(engine.getsockname()[1])
    assert pair.start() == [None, None]
    dealer = socket.socket()
    dealer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, small)
    dealer.connect(("127.0.0.1", port))
    payload = os.urandom(total)
    carried = None
    try:
        dealer.setblocking(False)
        taken = 0
        while taken < total:  # until the chain takes no more for 2 s: it is full
            if not select.select([], [dealer], [], 2.0)[1]:
                break
            taken += dealer.send(payload[taken:taken + (1 << 20)])
        carried, _ = engine.accept()
        assert taken < total
        held = pair.client.held_bytes() + pair.server.held_bytes()
        assert 0 < held <= SEND_BACKLOG + CHUNK + 2 * STREAM_WINDOW + (1 << 16)
        assert pair.client.sent_bytes - pair.server.received_bytes <= SEND_BACKLOG + CHUNK + STREAM_WINDOW

        dealer.setblocking(True)
        rest = threading.Thread(target=dealer.sendall, args=(payload[taken:],), daemon=True)
        rest.start()
        got = bytearray()
        carried.settimeout(WAIT)
        while len(got) < total:
            chunk = carried.recv(1 << 20)
            assert chunk, "the carried connection ended early"
            got += chunk
        assert got == payload
        rest.join(WAIT)
    finally:
        for sock in (dealer, carried, engine):
            if sock is not None:
                sock.close()


def test_the_roles_are_agreed_from_the_keys_and_bad_arguments_refused():
    own = PathCertificate.generate()
    assert matches_pin(own.certificate, own.fingerprint) and len(own.fingerprint) == 32
    assert not matches_pin(None, own.fingerprint)  # a client that presents no certificate is refused
    assert not matches_pin(PathCertificate.generate().certificate, own.fingerprint)
    assert role_for(b"\x01" * 32, b"\x02" * 32) == "client"
    assert role_for(b"\x02" * 32, b"\x01" * 32) == "server"
    sock = _udp()
    try:
        with pytest.raises(NetworkError, match="fingerprint must be 32 bytes"):
            QuicPath(sock, ("127.0.0.1", 9), "client", PathCertificate.generate(), b"short")
        with pytest.raises(ValueError, match="role must be one of"):
            QuicPath(sock, ("127.0.0.1", 9), "boss", PathCertificate.generate(), b"\0" * 32)
    finally:
        sock.close()
