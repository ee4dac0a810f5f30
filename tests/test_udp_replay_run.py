"""Engine traffic bound to the run: a message captured in an earlier run of a network task and played
into a later one before its sender's first message there must neither set that sender's UDP session
(nor take its TCP counters and connection) nor be taken, and the sender's own messages must be.

The runs' keys are the ones a real requester hands a provider (a bootstrap and two providers' RPC
servers on loopback: one refuses the task, so the requester drops that attempt and starts the task
again, a second run); the engines are real transports on loopback, sealed with those keys as
``TaskRun`` seals them."""

from __future__ import annotations

import socket
import threading
from contextlib import ExitStack

import pytest
import torch
import zmq
from helpers.netproc import running_in_thread
from helpers.pairs import close_together, connected
from helpers.waiting import wait_until

from meshlearn.errors import NetworkError, TaskFailed
from meshlearn.flat import FlatState
from meshlearn.layout import TensorLayout
from meshlearn.models import build_model
from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings
from meshlearn.network.channel.identity import peer_key
from meshlearn.network.channel.rpc import RpcServer, call
from meshlearn.network.requester.service import Requester
from meshlearn.network.task.spec import TaskRequest
from meshlearn.transport.settings import TcpSettings
from meshlearn.transport.tcp import TcpTransport
from meshlearn.transport.udp import UdpSettings, UdpTransport
from meshlearn.wire import Kind, Message
from meshlearn.wire.sealed import FrameSeal
from meshlearn.wire.sealed_datagram import DatagramSeal

SECRET = b"run-binding-test-secret"
HANDSHAKE = 20.0  # seconds a handshake may take: generous, never a speed test
GATHER = 20.0  # seconds a model may take to arrive (it comes in well under one)


class KeptKeys:
    """A provider's RPC server that takes every assignment (keeping the key it brings), is ready at
    once, drops the task when told to, and refuses the start: the task ends there."""

    def __init__(self):
        self.keys: list[bytes] = []
        self.state = "ready"
        self.server = RpcServer("provider", "127.0.0.1", 0, SECRET, {
            "task.assign": self._assign, "task.status": self._status, "task.cancel": self._cancel,
            "task.start": self._start})

    def _assign(self, req) -> dict:
        self.keys.append(peer_key(req.body["key"], "the task's key"))  # as the provider's Tasks.assign reads it
        self.state = "ready"
        return self._status(req)

    def _status(self, req) -> dict:
        return {"task": req.body["task"], "index": 0, "state": self.state, "engine": "tcp://127.0.0.1:9",
                "leader": "keeper", "results": False}

    def _cancel(self, req) -> dict:
        self.state = "cancelled"
        return {"cancelled": True}

    def _start(self, req) -> dict:
        raise NetworkError("the test ends the task here")


class Refusing:
    """A provider's RPC server that refuses every task."""

    def __init__(self):
        self.server = RpcServer("provider", "127.0.0.1", 0, SECRET, {
            "task.assign": self._refuse, "task.cancel": lambda req: {"cancelled": True}})

    def _refuse(self, req) -> dict:
        raise NetworkError("busy with another task")


@pytest.fixture(scope="module")
def run_keys(tmp_path_factory) -> tuple[bytes, bytes]:
    """The keys a requester gave the provider that took its task, in its first run and its second
    (the first dropped because the other provider refused it)."""
    folder = tmp_path_factory.mktemp("runs")
    bootstrap = Bootstrap(BootstrapSettings(host="127.0.0.1", port=0, state=str(folder / "b.sqlite"),
                                            dial_back=False), SECRET)
    keeper, refusing = KeptKeys(), Refusing()
    with ExitStack() as stack:
        for provider in (keeper, refusing):
            provider.server.start()
            stack.callback(provider.server.stop)
        stack.enter_context(running_in_thread(bootstrap))
        for name, provider in (("keeper", keeper), ("refusing", refusing)):
            call(bootstrap.server.address, "register", {"id": name, "address": provider.server.address, "ram_gb": 8.0,
                                                        "cores": 2, "device": "cpu", "location": ""}, SECRET, timeout=5)
        requester = Requester(TaskRequest(data_on_providers="digits", providers=2, wait=0), bootstrap.server.address,
                              SECRET, folder / "req", say=lambda _: None)
        with pytest.raises(TaskFailed, match="every provider is gone"):
            requester.run()
    assert len(keeper.keys) == 2, keeper.keys  # assigned in the first run, and again in the second
    return keeper.keys[0], keeper.keys[1]


def test_each_run_of_a_task_seals_with_a_key_of_its_own(run_keys):
    first, second = run_keys
    assert len(first) == len(second) == 32 and first != second


# ---- UDP ------------------------------------------------------------------------------------------

def _flat(seed: int) -> FlatState:
    torch.manual_seed(seed)
    return FlatState(build_model("lenet", (3, 32, 32), 10))


def _udp(rank: int, key: bytes, layout: TensorLayout) -> UdpTransport:
    settings = UdpSettings(chunk_bytes=4000, handshake_timeout=HANDSHAKE)
    return UdpTransport(rank, layout=layout, settings=settings, seal=DatagramSeal(key))


def _captured_udp_run(key: bytes, flat: FlatState, layout: TensorLayout) -> list[bytes]:
    """Run 1 on the path: node 0 shakes hands with node 1 and sends it a model; every datagram node 0
    sent (its HELLOs first), as someone on the path copied them."""
    a, b = _udp(0, key, layout), _udp(1, key, layout)
    sent: list[bytes] = []
    send = a.sender._send
    a.sender._send = lambda pieces, addr: sent.append(b"".join(bytes(p) for p in pieces)) or send(pieces, addr)
    try:
        connected(a, b)
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, flat.snapshot()))
        assert b.gather(0, [0], timeout=GATHER)[0].chunks.missing == 0
    finally:
        a.close()
        b.close()
    assert sent[0][5] == Kind.HELLO and any(d[5] == Kind.MODEL for d in sent)
    return sent


def test_a_datagram_of_an_earlier_run_played_first_sets_no_session_and_the_senders_own_are_taken(run_keys):
    first, second = run_keys
    earlier, now = _flat(1), _flat(2)  # what node 0 sent in each run
    layout = TensorLayout.uniform(now.ranges, now.state.dtype)
    replayed = _captured_udp_run(first, earlier, layout)
    a, b = _udp(0, second, layout), _udp(1, second, layout)
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        address_a, address_b = a.bind(), b.bind()
        shaking = threading.Thread(target=b.connect, args=({0: address_a},))
        shaking.start()  # b reads from now on; node 0 of this run has sent nothing yet
        target = ("127.0.0.1", int(address_b.rpartition(":")[2]))
        for datagram in replayed:
            attacker.sendto(datagram, target)
        assert wait_until(lambda: b.stats.bytes_received >= sum(map(len, replayed)), timeout=GATHER)
        a.connect({1: address_b})  # node 0's first datagram of this run comes after every replayed one
        shaking.join()
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, now.snapshot()))
        # a replayed chunk that does not open ends a wait for that chunk early, as any forged one does
        # (its header is not authenticated): the gather is held until node 0's own chunks are all in
        assert wait_until(lambda: b.reassembler.complete(0, 0), timeout=GATHER)
        got = b.gather(0, [0], timeout=GATHER)
        assert got[0].chunks.missing == 0 and torch.equal(got[0].chunks.vector, now.state)
        assert b.stats.malformed_dropped == len(replayed)  # another run's: none opens, each is counted
        assert b.stats.replay_dropped == 0  # node 0's own datagrams were all taken
    finally:
        attacker.close()
        a.close()
        b.close()


# ---- TCP ------------------------------------------------------------------------------------------

def _tcp(rank: int, key: bytes) -> TcpTransport:
    return TcpTransport(rank, settings=TcpSettings(handshake_timeout=HANDSHAKE, wait_timeout=GATHER, linger=0),
                        seal=FrameSeal(key))


def _captured_tcp_run(key: bytes, model: dict) -> list[list[bytes]]:
    """Run 1 on the path: node 0's messages to node 1 (its HELLO, then a model), as copied there."""
    a, b = _tcp(0, key), _tcp(1, key)
    sent: list[list[bytes]] = []
    send = a._send_frames
    a._send_frames = lambda peer, frames: sent.append([bytes(memoryview(f)) for f in frames]) or send(peer, frames)
    try:
        connected(a, b)
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, model))
        assert torch.equal(b.gather(0, [0], timeout=GATHER)[0].tensors["w"], model["w"])
    finally:
        close_together(a, b)
    return sent[:2]


def test_a_frame_of_an_earlier_run_played_first_takes_no_counter_and_no_connection(run_keys):
    first, second = run_keys
    earlier, now = {"w": torch.full((20_000,), 1.0)}, {"w": torch.full((20_000,), 2.0)}
    replayed = _captured_tcp_run(first, earlier)
    a, b = _tcp(0, second), _tcp(1, second)
    context = zmq.Context()
    attacker = context.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    try:
        address_a, address_b = a.bind(), b.bind()
        shaking = threading.Thread(target=b.connect, args=({0: address_a},))
        shaking.start()  # b reads from now on; node 0 of this run has sent nothing yet
        attacker.connect(address_b)
        for frames in replayed:  # the earlier run's HELLO (node 0's counter 1) and its model
            attacker.send_multipart(frames)
        wait_until(lambda: b.stats.bytes_received >= sum(len(f) for frames in replayed for f in frames),
                   timeout=GATHER)  # held until b read both (today's code stops reading after the HELLO)
        a.connect({1: address_b})
        shaking.join()
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, now))
        got = b.gather(0, [0], timeout=GATHER)
        assert 0 in got and torch.equal(got[0].tensors["w"], now["w"])
        assert b.stats.malformed_dropped == 2  # another run's: neither opens, each is counted
        assert b.stats.replay_dropped == 0 and b.stats.unknown_sender_dropped == 0  # node 0's own were taken
    finally:
        attacker.close()
        context.term()
        close_together(a, b)
