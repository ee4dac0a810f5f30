"""Issue 17: what the network mode's encryption and relay cost on a model exchange.

One 44.7 MB model (ResNet-18's size, a float32 state cut into the wire's 8 MiB segments, one
Kind.MODEL message) from one TcpTransport to another in a second process on loopback, best and
median, side by side in one run: (a) a raw TCP socket (the same bytes, for scale); TcpTransport
unsigned; (b) signed with an HMAC key (the plaintext path before issue 17); (c) sealed with a task
key (AES-256-GCM, ``wire.sealed.FrameSeal``, as network tasks build their engine transport in
``network.taskrun``); and (d) sealed, (e) signed, through a Relay in a third process, the
receiver's RelayAgent splicing the relay to the receiver's engine port and the sender connecting
to the allocation's address. Connections, handshakes and one warm-up message come before timing;
a time runs from the sender's ``send`` to the receiver's ``gather`` returning the decoded message.
Row (h) is (a) through the same Relay and RelayAgent: what relaying alone costs, without
ZeroMQ or encryption. One more row: FrameSeal's seal + open of the same message in one process, no transfer.

Two more rows: the same bytes as one blob of an RPC call (``agg.push``, result downloads and data
shares travel this way) over CurveZMQ, as the network mode runs it, and over plain ZeroMQ.

    python benchmarks/network_crypto.py [--mb 44.7] [--repeats 5] [--rounds 3]

Each row runs ``--rounds`` times, rows interleaved (a burst of load on a shared machine then
spoils one round of a row, not the row), ``--repeats`` timed messages each time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time

import torch
import zmq

# benchmarks/ is sys.path[0] when this runs as a script: the raw socket's receiver is secure_channels'
from secure_channels import _socket_receiver

from meshlearn.flat import SEGMENT_BYTES
from meshlearn.network.channel.identity import KeyPair
from meshlearn.network.channel.relay import Relay
from meshlearn.network.channel.relayagent import RelayAgent
from meshlearn.network.channel.rpc import RpcServer, call
from meshlearn.transport import TcpTransport
from meshlearn.transport.settings import TcpSettings
from meshlearn.wire import Kind, Message, encode
from meshlearn.wire.sealed import FrameSeal, decode_for

SECRET = b"benchmark-network-secret"
SETTINGS = TcpSettings(handshake_timeout=30, wait_timeout=30, linger=1)
HOST = "127.0.0.1"
RAW, SIGNED, SEALED = "(a) raw TCP socket", "(b) signed (HMAC)", "(c) sealed (AES-GCM task key)"
RAW_RELAYED = "(h) raw TCP socket, relayed (the relay's own cost)"
SEALED_RELAYED, SIGNED_RELAYED = "(d) sealed, relayed", "(e) signed, relayed"


def _payload(mb: float) -> dict[str, torch.Tensor]:
    """A flat float32 state of ``mb`` MB as the wire carries a model: named segments of 8 MiB."""
    torch.manual_seed(0)
    state = torch.randn(int(mb * 1e6 / 4))
    return {f"state.{i}": part for i, part in enumerate(torch.split(state, SEGMENT_BYTES // 4))}


# --- the processes ---

def _relay_process(pipe) -> None:
    relay = Relay(HOST, 0, HOST)
    relay.start()
    token, public = relay.allocate()
    pipe.send((relay.address, token, public))
    pipe.recv()  # until the run is over
    relay.stop()


def _receiver(pipe, secret: bytes | None, task_key: bytes | None, relay: tuple[str, str] | None,
              reps: int) -> None:
    seal = FrameSeal(task_key) if task_key else None
    transport = TcpTransport(1, HOST, 0, settings=SETTINGS, secret=secret, seal=seal)
    address = transport.bind()
    agent = None
    if relay is not None:  # behind NAT: agent connections parked at the relay, spliced to our engine port
        agent = RelayAgent(relay[0], relay[1], address.removeprefix("tcp://"))
        agent.start()
    pipe.send(address)
    transport.connect({0: pipe.recv()})
    pipe.send("ready")
    for iteration in range(reps + 1):  # iteration 0 is the warm-up
        got = transport.gather(iteration, [0], timeout=60)
        pipe.send(time.perf_counter() if got else None)
        del got
    transport.close()
    if agent is not None:
        agent.stop()


def transport_times(tensors: dict[str, torch.Tensor], reps: int, signed: bool, sealed: bool,
                    relayed: bool) -> list[float]:
    """One-way times of one MODEL message from TcpTransport 0 (here) to 1 (another process)."""
    secret = os.urandom(32) if signed else None
    task_key = FrameSeal.new_key() if sealed else None
    relay_pipe = relay_proc = allocation = None
    if relayed:
        relay_pipe, far = mp.Pipe()
        relay_proc = mp.Process(target=_relay_process, args=(far,))
        relay_proc.start()
        agent_port, token, allocation = relay_pipe.recv()
    mine, theirs = mp.Pipe()
    proc = mp.Process(target=_receiver, args=(theirs, secret, task_key,
                                              (agent_port, token) if relayed else None, reps))
    proc.start()
    transport = TcpTransport(0, HOST, 0, settings=SETTINGS, secret=secret,
                             seal=FrameSeal(task_key) if task_key else None)
    mine.send(transport.bind())
    direct = mine.recv()
    transport.connect({1: f"tcp://{allocation}" if relayed else direct})
    assert mine.recv() == "ready"
    times = []
    for iteration in range(reps + 1):
        start = time.perf_counter()
        transport.send(1, Message(Kind.MODEL, 0, iteration, 1, tensors))
        got = mine.recv()
        if got is None:
            raise RuntimeError(f"the receiver timed out on message {iteration}")
        if iteration:
            times.append(got - start)
    transport.close()
    proc.join()
    if relayed:
        relay_pipe.send("stop")
        relay_proc.join()
    return times


def _raw_receiver(listener: socket.socket, size: int, reps: int, pipe, relay: tuple[str, str] | None) -> None:
    agent = None
    if relay is not None:  # as a NATed receiver: its agent splices the allocation to its own listener
        agent = RelayAgent(relay[0], relay[1], f"{HOST}:{listener.getsockname()[1]}")
        agent.start()
    pipe.send("ready")
    _socket_receiver(listener, None, size, reps, pipe)
    if agent is not None:
        agent.stop()


def raw_times(payload: memoryview, reps: int, relayed: bool = False) -> list[float]:
    """One-way times of the same bytes over one plain TCP connection (sendall / recv_into), direct
    or through a Relay in a third process (no ZeroMQ, no encryption: what relaying alone costs)."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(1)
    relay_pipe = relay_proc = None
    target = listener.getsockname()
    if relayed:
        relay_pipe, far = mp.Pipe()
        relay_proc = mp.Process(target=_relay_process, args=(far,))
        relay_proc.start()
        agent_port, token, allocation = relay_pipe.recv()
        host, _, port = allocation.rpartition(":")
        target = (host, int(port))
    mine, theirs = mp.Pipe()
    proc = mp.Process(target=_raw_receiver, args=(listener, len(payload), reps + 1, theirs,
                                                  (agent_port, token) if relayed else None))
    proc.start()
    assert mine.recv() == "ready"
    sock = socket.create_connection(target)
    times = []
    for rep in range(reps + 1):  # the first is the warm-up
        start = time.perf_counter()
        sock.sendall(payload)
        got = mine.recv()
        if rep:
            times.append(got - start)
    proc.join()
    sock.close()
    listener.close()
    if relayed:
        relay_pipe.send("stop")
        relay_proc.join()
    return times


def _rpc_server(pipe, keys) -> None:
    server = RpcServer("bench", HOST, 0, SECRET, {"agg.push": lambda req: {"got": len(req.blobs[0])}},
                       max_bytes=1 << 30, keys=keys)
    server.start()
    pipe.send(server.reached_at(HOST))
    pipe.recv()
    server.stop()


def rpc_times(payload: memoryview, reps: int, curve: bool) -> list[float]:
    """Round trips of one call carrying ``payload`` as its blob (the reply is a few bytes)."""
    mine, theirs = mp.Pipe()
    proc = mp.Process(target=_rpc_server, args=(theirs, KeyPair.generate() if curve else None))
    proc.start()
    address = mine.recv()
    times = []
    for rep in range(reps + 1):  # the first is the warm-up
        start = time.perf_counter()
        call(address, "agg.push", {}, SECRET, blobs=[payload], timeout=60, max_bytes=1 << 30)
        if rep:
            times.append(time.perf_counter() - start)
    mine.send("stop")
    proc.join()
    return times


def seal_times(tensors: dict[str, torch.Tensor], reps: int) -> list[float]:
    """Seal + open (+ decode) of the message in this process: AES-GCM's share, without a transfer."""
    seal = FrameSeal(FrameSeal.new_key())
    times = []
    for iteration in range(reps + 1):
        start = time.perf_counter()
        decode_for(seal.close(encode(Message(Kind.MODEL, 0, iteration, 1, tensors))), 1 << 30, None, seal)
        if iteration:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=44.7, help="model size in MB (default: 44.7, ResNet-18)")
    parser.add_argument("--repeats", type=int, default=5, help="timed messages per row and round (default: 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every row, interleaved; best and median "
                                                              "over all rounds (default: 3)")
    args = parser.parse_args()
    mp.set_start_method("fork")
    tensors = _payload(args.mb)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    reps = args.repeats
    flat = memoryview(torch.cat(list(tensors.values())).numpy()).cast("B")
    cases = {
        RAW: lambda: raw_times(flat, reps),
        "TcpTransport, unsigned": lambda: transport_times(tensors, reps, signed=False, sealed=False, relayed=False),
        SIGNED: lambda: transport_times(tensors, reps, signed=True, sealed=False, relayed=False),
        SEALED: lambda: transport_times(tensors, reps, signed=False, sealed=True, relayed=False),
        SEALED_RELAYED: lambda: transport_times(tensors, reps, signed=False, sealed=True, relayed=True),
        SIGNED_RELAYED: lambda: transport_times(tensors, reps, signed=True, sealed=False, relayed=True),
    }
    cases[RAW_RELAYED] = lambda: raw_times(flat, reps, relayed=True)
    cases["(f) RPC blob over CurveZMQ (agg.push, results, data)"] = lambda: rpc_times(flat, reps, curve=True)
    cases["(g) RPC blob over plain ZeroMQ"] = lambda: rpc_times(flat, reps, curve=False)
    cases["FrameSeal seal + open, one process, no transfer"] = lambda: seal_times(tensors, reps)
    began = time.perf_counter()
    rows: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):  # every row once per round: a burst of load on this shared machine hits one round
        for name, case in cases.items():
            rows[name] += case()
    elapsed = time.perf_counter() - began

    best = {name: min(times) for name, times in rows.items()}
    median = {name: statistics.median(times) for name, times in rows.items()}
    print(f"{size / 1e6:g} MB one way ({len(tensors)} segments), best and median of {reps} x {args.rounds} rounds; "
          f"libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__}; {elapsed:.0f} s")
    print("| path | best | median | GB/s (best) | vs raw | vs signed |\n|---|---|---|---|---|---|")
    for name in rows:
        b = best[name]
        print(f"| {name} | {b * 1000:.1f} ms | {median[name] * 1000:.1f} ms | {size / b / 1e9:.2f} | "
              f"{b / best[RAW]:.2f}x | {b / best[SIGNED]:.2f}x |")
    ratios = {
        "encrypted / signed (c/b)": (SEALED, SIGNED),
        "encrypted / raw (c/a)": (SEALED, RAW),
        "relayed / direct, encrypted (d/c)": (SEALED_RELAYED, SEALED),
        "relayed / direct, signed (e/b)": (SIGNED_RELAYED, SIGNED),
        "relayed / direct, raw TCP (h/a)": (RAW_RELAYED, RAW),
    }
    print("\n| ratio | best / best | median / median |\n|---|---|---|")
    for label, (top, bottom) in ratios.items():
        print(f"| {label} | {best[top] / best[bottom]:.2f}x | {median[top] / median[bottom]:.2f}x |")


if __name__ == "__main__":
    main()
