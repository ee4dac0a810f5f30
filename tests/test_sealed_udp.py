"""Sealed UDP datagrams (a network task's UDP transport): each datagram sealed on its own with the
task's key, opened before anything of it is used, and taken once. Real sockets on loopback."""

from __future__ import annotations

import os
import random
import socket
import threading

import pytest
import torch
from helpers.pairs import connected
from helpers.waiting import wait_until

from meshlearn.errors import TransportError, WireError
from meshlearn.flat import FlatState
from meshlearn.layout import TensorLayout
from meshlearn.models import build_model
from meshlearn.transport.udp import UdpSettings, UdpTransport
from meshlearn.wire import Kind, Message
from meshlearn.wire.datagram import HEADER_SIZE, MAX_DATAGRAM, ChunkHeader, pack_header
from meshlearn.wire.sealed import FrameSeal
from meshlearn.wire.sealed_datagram import OVERHEAD, DatagramSeal, DatagramWindow

KEY = bytes(range(32))


def _sealed(seal: DatagramSeal, header: ChunkHeader, payload: bytes) -> bytes:
    head = pack_header(header, [memoryview(payload)])
    nonce, body = seal.close(head, payload)
    return head + nonce + body


def _open(seal: DatagramSeal, datagram: bytes, size: int) -> tuple[bytes, bytes, int]:
    out = bytearray(size)
    prefix, counter = seal.open(memoryview(datagram[:HEADER_SIZE]), memoryview(datagram[HEADER_SIZE:]),
                                memoryview(out))
    return bytes(out), prefix, counter


def test_a_sealed_datagram_opens_with_the_key_only_and_any_changed_byte_fails():
    header = ChunkHeader(Kind.MODEL, 3, 7, 0, 1, 64, 2, 40)
    payload = os.urandom(40)
    seal = DatagramSeal(KEY)
    datagram = _sealed(seal, header, payload)
    assert len(datagram) == HEADER_SIZE + 40 + OVERHEAD and payload not in datagram
    opened, prefix, counter = _open(DatagramSeal(KEY), datagram, 40)  # another seal of the same key opens it
    assert opened == payload and prefix == seal.prefix and counter == 1
    for at in (4, 8, HEADER_SIZE, HEADER_SIZE + 12, len(datagram) - 1):  # header, nonce, payload, tag
        changed = bytearray(datagram)
        changed[at] ^= 1
        with pytest.raises(WireError):
            _open(DatagramSeal(KEY), bytes(changed), 40)
    with pytest.raises(WireError, match="not sealed with this task's key"):
        _open(DatagramSeal(bytes(32)), datagram, 40)
    with pytest.raises(WireError, match="cannot hold"):
        _open(DatagramSeal(KEY), datagram[:-1], 40)
    assert _sealed(seal, header, payload)[HEADER_SIZE:HEADER_SIZE + 12] != datagram[HEADER_SIZE:HEADER_SIZE + 12]


def test_the_window_takes_each_datagram_once_reordered_or_not_and_one_session_a_sender():
    window = DatagramWindow(size=8)
    prefix = b"p" * 8
    assert window.admit(1, prefix, 5) is None
    assert window.admit(1, prefix, 3) is None  # overtaken on the way: still fresh
    assert "taken before" in window.admit(1, prefix, 3)
    assert "taken before" in window.admit(1, prefix, 5)
    assert window.admit(1, prefix, 20) is None
    assert "older than the window" in window.admit(1, prefix, 4)
    assert "another of its sessions" in window.admit(1, b"q" * 8, 21)
    assert window.admit(2, b"q" * 8, 1) is None  # another sender: its own session and counters


def _pair(flat: FlatState, keys: tuple[bytes, bytes] = (KEY, KEY), **settings) -> tuple[UdpTransport, UdpTransport]:
    layout = TensorLayout.uniform(flat.ranges, flat.state.dtype)
    return connected(*(UdpTransport(rank, layout=layout, settings=UdpSettings(**settings), seal=DatagramSeal(key))
                       for rank, key in enumerate(keys)))


@pytest.fixture
def lenet() -> FlatState:
    torch.manual_seed(0)
    return FlatState(build_model("lenet", (3, 32, 32), 10))


def test_sealed_transports_exchange_a_model_bit_for_bit_and_no_datagram_carries_it_in_the_clear(lenet):
    a, b = _pair(lenet, chunk_bytes=4000)
    sent: list[bytes] = []
    send = a.sender._send
    a.sender._send = lambda pieces, addr: sent.append(b"".join(bytes(p) for p in pieces)) or send(pieces, addr)
    try:
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, lenet.snapshot()))
        got = b.gather(0, [0], timeout=10)
        assert got[0].chunks.missing == 0 and torch.equal(got[0].chunks.vector, lenet.state)
        raw = lenet.state.numpy().tobytes()
        chunks = [d for d in sent if d[5] == Kind.MODEL]  # (a late HELLO may have been answered too)
        assert len(chunks) == -(-len(raw) // 4000)
        for k, datagram in enumerate(chunks):  # every chunk's plain bytes, looked for in what went out
            plain = raw[k * 4000:(k + 1) * 4000]
            assert plain[:64] not in datagram and plain[-64:] not in datagram
    finally:
        a.close()
        b.close()


def test_a_transport_with_another_key_hears_nothing_and_says_so_in_its_counters(lenet):
    layout = TensorLayout.uniform(lenet.ranges, lenet.state.dtype)
    a = UdpTransport(0, layout=layout, settings=UdpSettings(handshake_timeout=1), seal=DatagramSeal(KEY))
    b = UdpTransport(1, layout=layout, settings=UdpSettings(handshake_timeout=1), seal=DatagramSeal(bytes(32)))
    address_a, address_b = a.bind(), b.bind()
    failures = []
    thread = threading.Thread(target=lambda: _expect_failure(b, {0: address_a}, failures))
    thread.start()
    try:
        with pytest.raises(TransportError, match="did not answer the handshake"):
            a.connect({1: address_b})
        thread.join()
        assert failures and a.stats.malformed_dropped > 0 and b.stats.malformed_dropped > 0
    finally:
        a.close()
        b.close()


def _expect_failure(transport: UdpTransport, peers: dict, failures: list) -> None:
    try:
        transport.connect(peers)
    except TransportError as exc:
        failures.append(exc)


def test_forged_replayed_and_random_datagrams_are_dropped_and_counted_and_the_model_still_arrives(lenet):
    a, b = _pair(lenet, chunk_bytes=4000)
    captured: list[bytes] = []
    send = a.sender._send
    a.sender._send = lambda pieces, addr: captured.append(b"".join(bytes(p) for p in pieces)) or send(pieces, addr)
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    model = lambda: [d for d in captured if d[5] == Kind.MODEL]  # noqa: E731 (not a HELLO a late one answered)
    target = ("127.0.0.1", int(b.address.rpartition(":")[2]))
    rng = random.Random(0)
    try:
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, lenet.snapshot()))
        assert b.gather(0, [0], timeout=10)[0].chunks.missing == 0
        before = b.stats.as_dict()
        sent = model()
        for datagram in sent[:50]:  # played again: authentic, and taken before
            attacker.sendto(datagram, target)
        forged = ChunkHeader(Kind.MODEL, 0, 1, 0, -(-lenet.nbytes // 4000), 4000, 1, lenet.nbytes)
        for _ in range(200):  # a valid header, a body sealed with no key of the task
            attacker.sendto(_sealed(DatagramSeal(os.urandom(32)), forged, os.urandom(4000)), target)
        for _ in range(300):  # random bytes, and headers cut short
            attacker.sendto(os.urandom(rng.randrange(1, 9000)), target)
            attacker.sendto(sent[rng.randrange(len(sent))][:rng.randrange(1, HEADER_SIZE + 40)], target)
        assert wait_until(lambda: b.stats.replay_dropped - before["replay_dropped"] == 50, timeout=10)
        assert wait_until(lambda: b.stats.malformed_dropped - before["malformed_dropped"] >= 200 + 600 - 50,
                          timeout=10)
        a.broadcast([1], Message(Kind.MODEL, 0, 1, 1, lenet.snapshot()))  # the link still works
        got = b.gather(1, [0], timeout=10)
        assert got[0].chunks.missing == 0 and torch.equal(got[0].chunks.vector, lenet.state)
    finally:
        attacker.close()
        a.close()
        b.close()


def test_a_sealed_chunk_keeps_room_for_its_seal_on_the_path():
    flat = FlatState(torch.nn.Linear(2, 2))
    state = TensorLayout.uniform(flat.ranges, flat.state.dtype)
    loopback = UdpTransport(0, layout=state, seal=DatagramSeal(KEY))
    assert HEADER_SIZE + loopback.chunk_bytes + OVERHEAD <= MAX_DATAGRAM
    ethernet = UdpTransport(0, host="10.0.0.1", layout=state, seal=DatagramSeal(KEY))
    assert HEADER_SIZE + ethernet.chunk_bytes + OVERHEAD + 28 <= 1500  # IP and UDP headers: one Ethernet frame
    with pytest.raises(TransportError, match="no room for the seal"):
        UdpTransport(0, layout=state, settings=UdpSettings(chunk_bytes=65456), seal=DatagramSeal(KEY))
    assert DatagramSeal(FrameSeal(KEY).key).prefix != DatagramSeal(KEY).prefix  # a prefix per seal


def test_the_fuzzed_receiver_keeps_its_memory_flat(lenet):
    """A bounded loop of random and crafted datagrams at a sealed port: the receive thread keeps up,
    drops them all, and allocates nothing that stays."""
    import tracemalloc

    a, b = _pair(lenet, chunk_bytes=4000)
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    target = ("127.0.0.1", int(b.address.rpartition(":")[2]))
    header = ChunkHeader(Kind.MODEL, 0, 5, 0, -(-lenet.nbytes // 4000), 4000, 1, lenet.nbytes)
    head = pack_header(header)
    try:
        tracemalloc.start()
        for round_ in range(3):
            for _ in range(500):
                attacker.sendto(head + os.urandom(4000 + OVERHEAD), target)
            assert wait_until(lambda r=round_: b.stats.malformed_dropped >= 500 * (r + 1), timeout=20)
            if round_ == 0:
                baseline = tracemalloc.get_traced_memory()[0]
        grown = tracemalloc.get_traced_memory()[0] - baseline
        tracemalloc.stop()
        assert grown < 200_000, grown
        assert b.reassembler.chunks_lost == 0 and not b.stats.messages_received  # nothing forged was taken
    finally:
        attacker.close()
        a.close()
        b.close()
