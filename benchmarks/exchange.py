"""Exchange cost: one model's state from one node process to another, meshlearn TCP vs a raw socket.

Each trial moves the full flat state of a model (ResNet18 44.7 MB, SimpleCNN 4.6 MB, LeNet 0.36 MB)
from process A to process B and waits for a 1-byte acknowledgement sent after B has the data
in place: for meshlearn, decoded and copied into B's own model; for the raw socket, received with
recv_into a preallocated buffer. The two are interleaved trial by trial so machine noise hits both.

    python benchmarks/exchange.py [--models resnet18 simplecnn lenet] [--trials 30]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import torch

from meshlearn.flat import FlatState
from meshlearn.models import build_model
from meshlearn.transport import TcpTransport
from meshlearn.transport.settings import TcpSettings
from meshlearn.wire import Kind, Message

SHAPE = (3, 32, 32)


def _flat(name: str) -> FlatState:
    torch.manual_seed(0)
    return FlatState(build_model(name, SHAPE, 10))


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def receiver(name: str, trials: int, addr_q, raw_port_q) -> None:
    torch.set_num_threads(1)
    flat = _flat(name)
    transport = TcpTransport(1, settings=TcpSettings(handshake_timeout=60, wait_timeout=5))
    addr_q.put(transport.bind())
    peer_address = addr_q.get()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    raw_port_q.put(server.getsockname()[1])
    transport.connect({0: peer_address})
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw = bytearray(flat.nbytes)
    raw_view = memoryview(raw)
    for trial in range(trials):
        msg = transport.gather(trial, [0], timeout=60)[0]
        flat.load(msg.tensors)  # decode into the receiving model
        del msg
        transport.send(0, Message(Kind.MODEL, 1, trial, 1))
        _recv_exact(conn, raw_view)
        conn.sendall(b"k")
    conn.close()
    server.close()
    transport.close()


def sender(name: str, trials: int) -> tuple[list[float], list[float]]:
    flat = _flat(name)
    ctx = mp.get_context("spawn")
    addr_q, raw_port_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(name, trials, addr_q, raw_port_q))
    proc.start()
    transport = TcpTransport(0, settings=TcpSettings(handshake_timeout=60, wait_timeout=5))
    peer_address = addr_q.get()
    addr_q.put(transport.bind())
    raw_port = raw_port_q.get()
    transport.connect({1: peer_address})
    raw_sock = socket.create_connection(("127.0.0.1", raw_port))
    raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw_payload = memoryview(flat.state.numpy()).cast("B")
    ack = bytearray(1)
    mesh, raw = [], []
    for trial in range(trials):
        t0 = time.perf_counter()
        snapshot = flat.snapshot()
        flat.release(snapshot, transport.broadcast([1], Message(Kind.MODEL, 0, trial, 1, snapshot)))
        transport.gather(trial, [1], timeout=60)
        t1 = time.perf_counter()
        raw_sock.sendall(raw_payload)
        _recv_exact(raw_sock, memoryview(ack))
        t2 = time.perf_counter()
        mesh.append(t1 - t0)
        raw.append(t2 - t1)
    raw_sock.close()
    transport.close()
    proc.join()
    return mesh, raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "simplecnn", "lenet"])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':<10} {'MB':>7} {'meshlearn ms':>13} {'raw TCP ms':>11} {'ratio':>6}  (medians of {args.trials})")
    for name in args.models:
        mesh, raw = sender(name, args.trials + args.warmup)
        mesh, raw = mesh[args.warmup:], raw[args.warmup:]
        mb = _flat(name).nbytes / 1e6
        m, r = statistics.median(mesh), statistics.median(raw)
        print(f"{name:<10} {mb:7.2f} {m * 1000:13.2f} {r * 1000:11.2f} {m / r:6.2f}")


if __name__ == "__main__":
    main()
