"""Reflexive addresses: the datagram format, the reflector (pure core, rate bound, real sockets),
the client with loss and strangers' datagrams, the NAT's kind, ``ADDR`` on the relay's agent port,
the bootstrap serving both its ports, and a real masquerading NAT (network namespaces)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading

import pytest
from helpers.natlab import NatLab, natlab_available
from helpers.netproc import bindable, free_port, running_in_thread
from helpers.waiting import wait_until

from meshlearn.clock import FakeClock
from meshlearn.errors import NetworkError, PortInUseError, Unreachable, WireError
from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings
from meshlearn.network.channel.punch import punch_socket
from meshlearn.network.channel.reflector import Reflector, ReplyBudget, answer
from meshlearn.network.channel.reflexive import (
    DATAGRAM_SIZE,
    MAGIC,
    NONCE_SIZE,
    REPLY,
    REQUEST,
    VERSION,
    BadReflexive,
    NatKind,
    NatMapping,
    classify,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    nat_kind,
    reflexive_address,
    tcp_reflexive_address,
)
from meshlearn.network.channel.relay import Relay

NONCE = bytes(range(NONCE_SIZE))
HERE = ("127.0.0.1", 40000)


def udp_socket(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, 0))
    return sock


@pytest.fixture
def reflector():
    service = Reflector("127.0.0.1")
    ports = [service.bind(0), service.bind(0)]
    service.start()
    yield service, [("127.0.0.1", port) for port in ports]
    service.stop()


# --- the format ---

def test_a_request_and_a_reply_round_trip_and_a_reply_is_never_larger_than_its_request():
    request = encode_request(NONCE)
    reply = encode_reply(NONCE, ("198.18.1.2", 54321))
    assert decode_request(request) == NONCE
    assert decode_reply(reply) == (NONCE, ("198.18.1.2", 54321))
    assert len(request) == len(reply) == DATAGRAM_SIZE
    assert request.startswith(MAGIC) and request[4:6] == bytes([VERSION, REQUEST])
    assert reply.startswith(MAGIC) and reply[4:6] == bytes([VERSION, REPLY])


def _with(data: bytes, at: int, value: bytes) -> bytes:
    return data[:at] + value + data[at + len(value):]


REQUEST_BYTES = encode_request(NONCE)
REPLY_BYTES = encode_reply(NONCE, HERE)
MALFORMED = {
    "empty": (decode_request, b"", "0 bytes"),
    "short": (decode_request, REQUEST_BYTES[:-1], "31 bytes"),
    "long": (decode_request, REQUEST_BYTES + b"\0", "33 bytes"),
    "magic": (decode_request, _with(REQUEST_BYTES, 0, b"STUN"), "bad magic"),
    "version": (decode_request, _with(REQUEST_BYTES, 4, bytes([VERSION + 1])), "version 2"),
    "reply as request": (decode_request, REPLY_BYTES, "kind 2"),
    "request as reply": (decode_reply, REQUEST_BYTES, "kind 1"),
    "unknown kind": (decode_reply, _with(REPLY_BYTES, 5, b"\x07"), "kind 7"),
    "request padding": (decode_request, _with(REQUEST_BYTES, DATAGRAM_SIZE - 1, b"\x01"), "padding"),
    "reply padding": (decode_reply, _with(REPLY_BYTES, DATAGRAM_SIZE - 1, b"\x01"), "padding"),
    "port 0": (decode_reply, encode_reply(NONCE, ("127.0.0.1", 0)), "port 0"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_every_malformed_datagram_is_refused_with_its_own_error(case):
    decode, data, says = MALFORMED[case]
    with pytest.raises(BadReflexive, match=says) as refused:
        decode(data)
    assert isinstance(refused.value, WireError)


def test_a_nonce_of_the_wrong_size_is_refused_when_encoding():
    with pytest.raises(ValueError, match="16 bytes"):
        encode_request(b"short")


# --- the reflector's core and its bound ---

def test_the_pure_core_answers_a_request_with_its_source_and_drops_everything_else():
    nonce, seen = decode_reply(answer(encode_request(NONCE), ("203.0.113.9", 6000)))
    assert (nonce, seen) == (NONCE, ("203.0.113.9", 6000))
    for case, (_, data, _) in MALFORMED.items():
        if data != REQUEST_BYTES:
            assert answer(data, HERE) is None, case
    assert answer(REQUEST_BYTES, ("::1", 6000, 0, 0)) is None  # IPv6: not served
    assert answer(REQUEST_BYTES, ("not-an-address", 6000)) is None


def test_the_reply_budget_allows_a_burst_then_the_rate():
    clock = FakeClock()
    budget = ReplyBudget(rate=10, burst=3, clock=clock)
    assert [budget.take() for _ in range(4)] == [True, True, True, False]
    clock.advance(0.15)  # one and a half replies' worth: the half is kept
    assert [budget.take() for _ in range(2)] == [True, False]
    clock.advance(0.05)
    assert budget.take()
    clock.advance(60)  # a long quiet: back to the burst, not beyond
    assert sum(budget.take() for _ in range(10)) == 3


def test_a_flood_beyond_the_rate_is_dropped_and_counted_and_strangers_datagrams_are_too(caplog):
    clock = FakeClock()
    service = Reflector("127.0.0.1", rate=1, burst=3, clock=clock)
    server = ("127.0.0.1", service.bind(0))
    service.start()
    try:
        with udp_socket() as client:
            for i in range(5):
                client.sendto(encode_request(bytes([i]) * NONCE_SIZE), server)
            client.sendto(b"GET / HTTP/1.0\r\n\r\n", server)
            assert wait_until(lambda: service.answered + service.limited + service.invalid == 6)
            assert (service.answered, service.limited, service.invalid) == (3, 2, 1)
            client.settimeout(5)
            nonces = {decode_reply(client.recv(64))[0][0] for _ in range(3)}
            assert nonces == {0, 1, 2}
            clock.advance(1.0)  # one more token
            client.sendto(encode_request(NONCE), server)
            assert decode_reply(client.recv(64)) == (NONCE, client.getsockname())
    finally:
        service.stop()
    assert "no reflexive-address request" in caplog.text and "over 1 answers a second" in caplog.text


def test_a_reflector_on_every_interface_answers_from_the_address_it_was_asked_at():
    """Else a NAT would drop the answer of a machine with several addresses (the lab below shows it):
    asked at 127.0.0.2, it answers from 127.0.0.2, not from the route's 127.0.0.1."""
    service = Reflector("0.0.0.0")
    port = service.bind(0)
    service.start()
    try:
        with udp_socket() as sock:
            sock.settimeout(5)
            sock.sendto(encode_request(NONCE), ("127.0.0.2", port))
            reply, source = sock.recvfrom(64)
            assert source == ("127.0.0.2", port)
            assert decode_reply(reply) == (NONCE, sock.getsockname())
    finally:
        service.stop()


def test_a_taken_port_is_refused_in_one_line_unless_it_may_be_skipped(caplog):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        service = Reflector("127.0.0.1")
        with pytest.raises(PortInUseError, match=f"UDP port {port} on 127.0.0.1 is in use"):
            service.bind(port)
        with caplog.at_level(logging.WARNING):
            assert service.bind(port, required=False) is None
        assert service.sockets == []
        service.stop()
    assert f"not served on UDP port {port}" in caplog.text


# --- the client ---

def test_the_client_learns_its_own_address_from_a_real_reflector_and_leaves_its_socket_as_it_was(reflector):
    service, servers = reflector
    with udp_socket() as sock:
        sock.setblocking(False)
        assert reflexive_address(sock, servers[0], timeout=5) == sock.getsockname()
        assert reflexive_address(sock, servers[1], timeout=5) == sock.getsockname()
        assert sock.getblocking() is False
    assert wait_until(lambda: service.answered == 2)


def test_the_client_asks_again_after_a_lost_request_and_ignores_datagrams_not_its_answer():
    """A fake server drops the first request; before answering the second, it sends a stranger's
    datagram and a reply with another nonce (claiming another address): the client takes neither."""
    seen: list[bytes] = []
    with udp_socket() as server, udp_socket() as sock:
        server.settimeout(10)

        def serve() -> None:
            seen.append(server.recvfrom(64)[0])  # lost
            request, source = server.recvfrom(64)
            seen.append(request)
            server.sendto(b"not for you", source)
            server.sendto(encode_reply(b"\xff" * NONCE_SIZE, ("192.0.2.1", 9)), source)
            server.sendto(answer(request, source), source)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        assert reflexive_address(sock, server.getsockname(), timeout=5) == sock.getsockname()
        thread.join(10)
    assert len(seen) == 2 and seen[0] == seen[1]  # sent again with the same nonce: a late answer counts


def test_the_client_says_unreachable_in_one_line_when_nobody_answers():
    with udp_socket() as silent, udp_socket() as sock:
        with pytest.raises(Unreachable) as refused:
            reflexive_address(sock, silent.getsockname(), timeout=0.5)
        received = 0
        silent.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while silent.recv(64):
                received += 1
    message = str(refused.value)
    assert "no answer from the bootstrap at 127.0.0.1:" in message and "\n" not in message
    assert received == 5  # SENDS requests, all of them sent


# --- the NAT's kind ---

def test_classify_tells_open_cone_and_symmetric_apart():
    local, public = ("10.1.0.2", 5000), ("198.18.1.2", 5000)
    assert classify(local, local, local) == NatMapping(NatKind.OPEN, local)
    assert classify(local, public, public) == NatMapping(NatKind.CONE, public)
    assert classify(local, public, ("198.18.1.2", 61000)) == NatMapping(NatKind.SYMMETRIC, public)
    assert classify(local, local, public).kind == NatKind.SYMMETRIC  # answers that differ are never open


def test_nat_kind_on_loopback_is_open_even_from_a_socket_bound_to_every_interface(reflector):
    _, servers = reflector
    with udp_socket() as sock:
        assert nat_kind(sock, sock.getsockname(), servers, timeout=5) == NatMapping(NatKind.OPEN, sock.getsockname())
    with udp_socket("0.0.0.0") as sock:
        port = sock.getsockname()[1]
        assert nat_kind(sock, ("0.0.0.0", port), servers, timeout=5) == NatMapping(NatKind.OPEN, ("127.0.0.1", port))


# --- TCP: ADDR on the relay's agent port ---

@pytest.fixture
def relay():
    service = Relay("127.0.0.1", 0, "127.0.0.1", key_line="THE-KEY")
    service.start()
    yield ("127.0.0.1", service.port)
    service.stop()


def test_the_relay_answers_addr_with_the_connections_own_address(relay):
    with socket.create_connection(relay, timeout=5) as sock:
        sock.sendall(b"ADDR\n")
        assert sock.makefile("rb").readline() == f"meshlearn-addr 127.0.0.1:{sock.getsockname()[1]}\n".encode()


def test_tcp_reflexive_address_asks_from_a_port_that_can_be_bound_again_at_once(relay):
    with punch_socket("127.0.0.1", 0) as holder:  # holds a port, as a punching peer's listener would
        port = holder.getsockname()[1]
        assert tcp_reflexive_address(port, relay, timeout=5, local_host="127.0.0.1") == ("127.0.0.1", port)
        assert tcp_reflexive_address(port, relay, timeout=5, local_host="127.0.0.1") == ("127.0.0.1", port)
        punch_socket("127.0.0.1", port).close()


def test_tcp_reflexive_address_says_what_went_wrong_in_one_line():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = closed.getsockname()
    with pytest.raises(Unreachable, match="cannot ask the relay at .* connection refused"):
        tcp_reflexive_address(0, nobody, timeout=5)
    with socket.create_server(("127.0.0.1", 0)) as other:
        def answer_nonsense() -> None:
            conn, _ = other.accept()
            with conn:
                conn.sendall(b"HTTP/1.0 400 Bad Request\n")
        thread = threading.Thread(target=answer_nonsense, daemon=True)
        thread.start()
        with pytest.raises(NetworkError, match="did not announce an address"):
            tcp_reflexive_address(0, other.getsockname(), timeout=5)
        thread.join(10)


# --- the bootstrap ---

def test_the_bootstrap_answers_on_its_own_and_its_relays_port_numbers_and_frees_them(tmp_path):
    port = free_port()
    service = Bootstrap(BootstrapSettings(host="127.0.0.1", port=port, state=str(tmp_path / "b.sqlite"),
                                          dial_back=False), b"reflexive-test-secret")
    with running_in_thread(service), udp_socket() as sock:
        for server_port in (port, port + 1):
            assert reflexive_address(sock, ("127.0.0.1", server_port), timeout=5) == sock.getsockname()
        assert wait_until(lambda: service.reflector.answered == 2)
    for server_port in (port, port + 1):  # stopped with the bootstrap
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as again:
            again.bind(("127.0.0.1", server_port))


def test_a_bootstrap_whose_udp_port_is_taken_says_so_and_leaves_nothing_behind(tmp_path):
    port = free_port()
    service = Bootstrap(BootstrapSettings(host="127.0.0.1", port=port, state=str(tmp_path / "b.sqlite"),
                                          dial_back=False), b"reflexive-test-secret")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
        holder.bind(("127.0.0.1", port + 1))
        with pytest.raises(PortInUseError, match=f"UDP port {port + 1} on 127.0.0.1 is in use"):
            service.run()
    assert not (tmp_path / "b.sqlite").exists()
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):  # ZeroMQ closes its listener in its own thread, soon
        for server_port in (port, port + 1):
            assert wait_until(lambda: bindable(kind, server_port)), (kind, server_port)


# --- a real NAT ---

# A reflector in the lab's public namespace on two ports; prints them, serves until stdin closes.
REFLECTOR = r"""
import sys
from meshlearn.network.channel.reflector import Reflector
service = Reflector("0.0.0.0")
ports = [service.bind(0), service.bind(0)]
service.start()
print(*ports, flush=True)
sys.stdin.read()
service.stop()
"""


@pytest.fixture(scope="module")
def nat_reflector():
    reason = natlab_available()
    if reason:
        pytest.skip(reason)
    with NatLab(homes=2, symmetric=(2,)) as lab:
        proc = subprocess.Popen(lab.command("pub", [sys.executable, "-c", REFLECTOR]), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            ports = [int(p) for p in proc.stdout.readline().split()]
            assert len(ports) == 2, "the reflector in pub did not start"
            yield lab, [(lab.public_ip, p) for p in ports]
        finally:
            proc.kill()
            proc.wait(10)


def _ask_from_home(lab: NatLab, home: int, servers: list[tuple[str, int]]) -> tuple[NatMapping, int]:
    with lab.socket(f"h{home}", type=socket.SOCK_DGRAM) as sock:
        sock.bind((lab.home_ip(home), 0))
        port = sock.getsockname()[1]
        return nat_kind(sock, (lab.home_ip(home), port), servers, timeout=5), port


def test_behind_a_masquerading_nat_a_socket_learns_its_routers_address_and_a_cone_mapping(nat_reflector):
    lab, servers = nat_reflector
    mapping, port = _ask_from_home(lab, 1, servers)
    assert mapping == NatMapping(NatKind.CONE, (lab.router_ip(1), port))  # plain masquerade keeps the port


def test_behind_a_nat_that_maps_each_flow_to_a_random_port_the_mapping_is_symmetric(nat_reflector):
    lab, servers = nat_reflector
    mapping, _ = _ask_from_home(lab, 2, servers)
    assert mapping.kind == NatKind.SYMMETRIC and mapping.address[0] == lab.router_ip(2)
