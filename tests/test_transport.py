"""TCP transport between real processes on loopback."""

import contextlib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from helpers.netproc import free_port
from helpers.pairs import close_together
from helpers.waiting import wait_until

from meshlearn.errors import PortInUseError, TransportError
from meshlearn.transport import TcpTransport
from meshlearn.transport.ports import ensure_port_free
from meshlearn.transport.settings import TcpSettings
from meshlearn.wire import Kind, Message, encode

PEER = Path(__file__).parent / "helpers" / "peer.py"


@pytest.fixture
def local():
    transport = TcpTransport(0, settings=TcpSettings(handshake_timeout=20, wait_timeout=5, linger=1))
    transport.bind()
    yield transport
    transport.close()


@pytest.fixture
def spawn():
    procs = []

    def start(mode: str, address: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen(
            [sys.executable, str(PEER), "1", "0", address, mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        procs.append(proc)
        return proc, proc.stdout.readline().strip()

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_delivery_and_ordering_by_iteration(local, spawn):
    proc, address = spawn("out-of-order", local.address)
    local.connect({1: address})
    for iteration in range(3):  # sent as 2, 0, 1: the future one waits in the buffer
        got = local.gather(iteration, [1], timeout=20)
        assert torch.equal(got[1].tensors["p"], torch.full((1000,), float(iteration)))
    local.close()
    assert proc.wait(timeout=20) == 0
    assert local.stats.messages_received >= 4  # HELLO + three models (+ BYE)
    assert local.stats.bytes_received > 3 * 4000
    assert local.stats.gather_timeouts == 0


def test_round_trip_large_model_and_byte_counters(local, spawn):
    proc, address = spawn("echo", local.address)
    local.connect({1: address})
    payload = torch.randn(3_000_000)  # 12 MB: goes out zero-copy
    local.send(1, Message(Kind.MODEL, 0, 0, 1, {"p": payload}))
    got = local.gather(0, [1], timeout=20)
    assert torch.equal(got[1].tensors["p"], payload * 2)
    assert local.stats.bytes_sent > 12_000_000 and local.stats.bytes_received > 12_000_000
    local.close()
    assert proc.wait(timeout=20) == 0


def test_stale_messages_dropped_and_counted(local, spawn):
    proc, address = spawn("out-of-order", local.address)
    local.connect({1: address})
    got = local.gather(2, [1], timeout=20)  # iterations 0 and 1 arrive after 2: stale
    assert float(got[1].tensors["p"][0]) == 2.0
    assert local.gather(3, [1], timeout=30.0) == {}  # the peer says BYE: no wait for it (no timeout counted)
    assert local.stats.gather_timeouts == 0
    assert local.stats.stale_dropped == 2
    local.close()
    assert proc.wait(timeout=20) == 0


def _until(condition, transport, seconds: float = 20.0) -> None:
    """Receive (and drop) messages until ``condition()`` holds."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        transport.recv(0.05)


def test_dead_neighbour_handshake_names_it():
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as silent:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        transport = TcpTransport(0, settings=TcpSettings(handshake_timeout=1.0, wait_timeout=0.5))
        transport.bind()
        start = time.monotonic()
        with pytest.raises(TransportError, match=rf"neighbour\(s\) 4 at tcp://127.0.0.1:{port} did not answer"):
            transport.connect({4: f"tcp://127.0.0.1:{port}"})
        assert time.monotonic() - start < 10
        transport.close()


def test_silent_neighbour_times_out_without_failing(local, spawn):
    proc, address = spawn("hang", local.address)
    local.connect({1: address})
    assert local.gather(0, [1], timeout=0.5) == {}
    assert local.stats.gather_timeouts == 1
    proc.kill()
    local.bye_timeout = 0.5  # the peer is gone: do not wait for its BYE


def test_malformed_and_spoofed_messages_are_dropped(local, spawn):
    proc, address = spawn("echo", local.address)
    local.connect({1: address})
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as rogue:
        rogue.setsockopt(zmq.ROUTING_ID, b"\x09\x00\x00\x00")  # node 9 is not a neighbour
        rogue.setsockopt(zmq.LINGER, 1000)
        rogue.connect(local.address)
        rogue.send_multipart([b"MSHL garbage", b"x"])
        rogue.send_multipart([b"\x00" * 3])
        rogue.send_multipart(encode(Message(Kind.MODEL, 9, 0, 1, {"p": torch.ones(3)})))  # unknown sender
        rogue.send_multipart(encode(Message(Kind.MODEL, 1, 0, 1, {"p": torch.ones(3)})))  # claims to be node 1
        _until(lambda: local.stats.malformed_dropped + local.stats.unknown_sender_dropped == 4, local)
    assert local.stats.messages_received == 1  # the peer's HELLO only: nothing of the rogue's got through
    assert local.stats.malformed_dropped == 2
    assert local.stats.unknown_sender_dropped == 2
    local.send(1, Message(Kind.MODEL, 0, 0, 1, {"p": torch.ones(3)}))  # still works afterwards
    assert torch.equal(local.gather(0, [1], timeout=20)[1].tensors["p"], torch.full((3,), 2.0))
    local.close()
    proc.wait(timeout=20)


def test_port_in_use_is_a_clear_error(local):
    port = int(local.address.rsplit(":", 1)[1])
    with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is in use"):
        ensure_port_free("127.0.0.1", port)
    other = TcpTransport(1, port=port)
    with pytest.raises(PortInUseError):
        other.bind()


def test_a_neighbour_without_the_secret_is_never_heard():
    """Two nodes signing with different secrets: each drops the other's messages, the handshake names it."""
    a = TcpTransport(0, settings=TcpSettings(handshake_timeout=1.5, wait_timeout=1), secret=b"secret-of-the-network")
    b = TcpTransport(1, settings=TcpSettings(handshake_timeout=1.5, wait_timeout=1), secret=b"some-other-secret")
    try:
        addresses = {0: a.bind(), 1: b.bind()}
        import threading

        errors = []
        other = threading.Thread(target=lambda: errors.append(_connect_error(b, {0: addresses[0]})))
        other.start()
        with pytest.raises(TransportError, match="did not answer the handshake"):
            a.connect({1: addresses[1]})
        other.join()
        assert errors and "did not answer" in errors[0]
        assert a.stats.malformed_dropped >= 1 and b.stats.malformed_dropped >= 1
    finally:
        a.close()
        b.close()


def _connect_error(transport: TcpTransport, peers: dict) -> str:
    try:
        transport.connect(peers)
    except TransportError as exc:
        return str(exc)
    return ""


@pytest.fixture
def pair():
    """Nodes 0 and 1 in this process, handshake done; closed after the test."""
    import threading

    a, b = (TcpTransport(i, settings=TcpSettings(handshake_timeout=20, wait_timeout=5, linger=1)) for i in range(2))
    a.bind(), b.bind()
    thread = threading.Thread(target=b.connect, args=({0: a.address},))
    thread.start()
    a.connect({1: b.address})
    thread.join()
    yield a, b
    b.bye_timeout = a.bye_timeout = 0.5
    a.close()
    b.close()


def test_a_connection_claiming_a_neighbours_identity_neither_silences_nor_speaks_for_it(pair):
    a, b = pair
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as rogue:
        rogue.setsockopt(zmq.ROUTING_ID, b"\x01\x00\x00\x00")  # node 1's id, when ids were node numbers
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(a.address)
        rogue.send_multipart(encode(Message(Kind.MODEL, 1, 0, 1, {"p": torch.zeros(3)})))  # no HELLO first
        _until(lambda: a.stats.unknown_sender_dropped == 1, a)
        for iteration in range(3):  # node 1's own connection still works
            b.send(0, Message(Kind.MODEL, 1, iteration, 1, {"p": torch.full((3,), float(iteration))}))
            assert torch.equal(a.gather(iteration, [1], timeout=10)[1].tensors["p"], torch.full((3,), float(iteration)))


def test_messages_kept_for_later_iterations_are_capped_per_sender(pair):
    from meshlearn.transport.base import MAX_PENDING_PER_SENDER

    a, b = pair
    for iteration in range(1000, 1030):  # far ahead: a peer (or one claiming to be it) floods
        b.send(0, Message(Kind.MODEL, 1, iteration, 1, {"p": torch.zeros(3)}))
    b.send(0, Message(Kind.MODEL, 1, 0, 1, {"p": torch.ones(3)}))
    b.send(0, Message(Kind.MODEL, 1, 1, 1, {"p": torch.ones(3)}))
    assert torch.equal(a.gather(0, [1], timeout=10)[1].tensors["p"], torch.ones(3))
    assert sorted(a._pending) == list(range(1000, 1000 + MAX_PENDING_PER_SENDER))  # the nearest kept
    assert a.stats.overflow_dropped == 30 - MAX_PENDING_PER_SENDER
    assert torch.equal(a.gather(1, [1], timeout=10)[1].tensors["p"], torch.ones(3))


def test_a_neighbour_that_missed_three_deadlines_is_not_waited_for_until_heard_again(pair):
    """A dead D-PSGD neighbour (SIGKILL says no BYE) used to cost a whole timeout every iteration."""
    from meshlearn.transport.base import SILENT_AFTER

    a, b = pair
    for iteration in range(SILENT_AFTER + 5):  # b has gone quiet
        assert a.gather(iteration, [1], timeout=0.2) == {}
    assert a.silent == {1}
    assert a.stats.gather_timeouts == SILENT_AFTER  # then it stopped waiting (and timing out)
    b.send(0, Message(Kind.MODEL, 1, 20, 1, {"p": torch.ones(3)}))  # back: read as soon as it is there
    assert wait_until(lambda: 1 in a.gather(20, [1], timeout=0.2), timeout=10)
    assert a.silent == set()
    assert a.gather(21, [1], timeout=0.2) == {} and a.stats.gather_timeouts == SILENT_AFTER + 1  # waited for again


def test_no_exclusion_is_lost_to_joins_taken_in_at_the_same_time_and_no_join_either():
    """Exclusions (a revoked provider) and joins (a newcomer) replace the book from two threads:
    10,000 rounds of each interleaved (in 10 books of 1,000, so each copy stays small), every book
    ends without any excluded peer and with every joined one; an excluded peer that asks to join
    again is not taken back."""
    for _ in range(10):
        _race_joins_and_exclusions(1_000)


def _race_joins_and_exclusions(rounds: int) -> None:
    transport = TcpTransport(0)
    transport.peers = {2 * k: f"tcp://127.0.0.1:{k + 1}" for k in range(rounds)}  # even: to be excluded
    transport._ctx = object()  # the join path dials each newcomer: no sockets here, the book's rules only
    transport._dial = lambda peer, address: None
    start = threading.Barrier(2)

    def joins():
        start.wait()
        for k in range(rounds):
            transport.add_peer(2 * k + 1, f"tcp://127.0.0.1:{k + 1}")  # odd: newcomers
            transport.add_peer(2 * k, f"tcp://127.0.0.1:{k + 1}")  # an even one again: excluded, or about to be
            transport._take_in_joined()

    def exclusions():
        start.wait()
        for k in range(rounds):
            transport.exclude(2 * k)

    threads = [threading.Thread(target=joins), threading.Thread(target=exclusions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    transport._take_in_joined()
    assert not [p for p in transport.peers if p % 2 == 0], "an exclusion was lost"
    assert sorted(transport.peers) == list(range(1, 2 * rounds, 2)), "a join was lost"


class Meeting:
    """Stands for a path punched through two NATs: two listeners on loopback, each taking one
    side's outgoing connection, joined byte for byte. Each side's ZeroMQ socket connected out,
    as each does in a simultaneous open; on loopback they meet here instead of on the wire."""

    def __init__(self):
        self.listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
        self.ports = [listener.getsockname()[1] for listener in self.listeners]
        self.thread = threading.Thread(target=self._join, daemon=True)
        self.thread.start()

    def _join(self):
        ends = [listener.accept()[0] for listener in self.listeners]
        for source, sink in (ends, ends[::-1]):
            threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source, sink):
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self):
        for listener in self.listeners:
            listener.close()


def test_a_router_that_meets_a_neighbours_dealer_connecting_out_too_carries_its_link():
    """Each side of a punched link connects out (the DEALER from its punching port, the neighbour's
    ROUTER ``meet``ing it): the handshake and a model go through, both ways."""
    a, b = (TcpTransport(i, settings=TcpSettings(handshake_timeout=20, wait_timeout=10, linger=1)) for i in (0, 1))
    meetings = [Meeting(), Meeting()]  # a -> b, b -> a
    try:
        for transport in (a, b):
            transport.bind()
        a_to_b, b_to_a = meetings
        source = free_port()  # for the DEALER to connect from, as from a punched port
        b.meet(0, f"tcp://127.0.0.1:0;127.0.0.1:{a_to_b.ports[1]}")
        a.meet(1, f"tcp://127.0.0.1:0;127.0.0.1:{b_to_a.ports[1]}")
        dead = free_port()  # the fallback, never needed: each path carries its handshake at once
        a.fall_back(1, f"tcp://127.0.0.1:{dead}", after=0.2)
        b.fall_back(0, f"tcp://127.0.0.1:{dead}", after=0.2)
        _connect_both(a, {1: f"tcp://127.0.0.1:{source};127.0.0.1:{a_to_b.ports[0]}"},
                      b, {0: f"tcp://127.0.0.1:0;127.0.0.1:{b_to_a.ports[0]}"})
        time.sleep(0.3)  # past the fallbacks' deadline: the links must stay where they are
        a.send(1, Message(Kind.MODEL, 0, 0, 1, {"p": torch.arange(10.0)}))
        b.send(0, Message(Kind.MODEL, 1, 0, 1, {"p": torch.ones(3)}))
        assert torch.equal(b.gather(0, [0], timeout=20)[0].tensors["p"], torch.arange(10.0))
        assert torch.equal(a.gather(0, [1], timeout=20)[1].tensors["p"], torch.ones(3))
    finally:
        close_together(a, b)
        for meeting in meetings:
            meeting.close()


def test_only_a_transport_with_one_connection_per_neighbour_meets_and_only_at_a_tcp_source_and_target():
    from meshlearn.transport.hub import HubEndpoint

    transport = TcpTransport(0)
    assert TcpTransport.meets and not HubEndpoint.meets
    with pytest.raises(TransportError, match="expected tcp://SOURCE:PORT;TARGET:PORT"):
        transport.meet(1, "tcp://127.0.0.1:5000")
    with pytest.raises(TransportError, match="HubEndpoint cannot meet neighbour 1"):
        HubEndpoint(0).meet(1, "tcp://127.0.0.1:1;127.0.0.1:2")


def _connect_both(a: TcpTransport, book_a: dict, b: TcpTransport, book_b: dict) -> None:
    """Both handshakes at once (each waits for the other's HELLO); raises what either raised."""
    failed = []

    def connect(transport, book):
        try:
            transport.connect(book)
        except Exception as exc:
            failed.append(exc)
    threads = [threading.Thread(target=connect, args=pair) for pair in ((a, book_a), (b, book_b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failed and not any(thread.is_alive() for thread in threads), failed


def test_a_punched_path_that_carries_no_handshake_falls_back_in_time_and_the_link_works():
    """The DEALER's punched path leads nowhere (the NATs let the punch through, not the engine's
    connect): after ``after`` seconds it dials the fallback (a front, carrying it through the
    relay), says HELLO again, and the handshake and a model go through within the timeout."""
    settings = TcpSettings(handshake_timeout=20, wait_timeout=10, linger=1)
    a, b = (TcpTransport(i, settings=settings) for i in (0, 1))
    try:
        address_a, address_b = a.bind(), b.bind()
        a.fall_back(1, address_b, after=0.5)
        _connect_both(a, {1: f"tcp://127.0.0.1:{free_port()};127.0.0.1:{free_port()}"}, b, {0: address_a})
        a.send(1, Message(Kind.MODEL, 0, 0, 1, {"p": torch.arange(5.0)}))
        assert torch.equal(b.gather(0, [0], timeout=20)[0].tensors["p"], torch.arange(5.0))
        assert a._watching == {}
    finally:
        close_together(a, b)
