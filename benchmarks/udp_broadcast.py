"""UDP broadcast cost at the sender: one model to several neighbours (D-PSGD's send step).

Times ``UdpTransport.broadcast`` of a ResNet18 state (44.7 MB) to N plain UDP sockets with large
receive buffers, drained between trials, so only the sender's work (headers, checksums,
``sendmsg``, the kernel's copy) is measured. Unpaced.

    python benchmarks/udp_broadcast.py [--neighbours 3] [--trials 15] [--chunk-bytes 0]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch

from meshlearn.flat import FlatState
from meshlearn.layout import TensorLayout
from meshlearn.models import build_model
from meshlearn.transport.udp import (
    SO_RCVBUFFORCE,
    UdpSettings,
    UdpTransport,
)
from meshlearn.wire import Kind, Message


def _drain(sock: socket.socket) -> None:
    try:
        while True:
            sock.recv(1 << 17)
    except BlockingIOError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--neighbours", type=int, default=3)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--chunk-bytes", type=int, default=0, help="0 = the transport default for loopback")
    args = parser.parse_args()
    torch.manual_seed(0)
    flat = FlatState(build_model(args.model, (3, 32, 32), 10))
    sinks = []
    for _ in range(args.neighbours):
        sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sink.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 128 << 20)
        except OSError:
            sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 128 << 20)
        sink.bind(("127.0.0.1", 0))
        sink.setblocking(False)
        sinks.append(sink)
    sender = UdpTransport(0, layout=TensorLayout.uniform(flat.ranges, flat.state.dtype),
                          settings=UdpSettings(chunk_bytes=args.chunk_bytes, rate_gbps=float("inf")))
    sender.bind()
    sender._addrs = {i + 1: sink.getsockname() for i, sink in enumerate(sinks)}  # no handshake: sinks are plain sockets
    snapshot = flat.snapshot()
    peers = list(sender._addrs)
    times = []
    try:
        for trial in range(args.trials):
            start = time.perf_counter()
            sender.broadcast(peers, Message(Kind.MODEL, 0, trial, len(peers), snapshot))
            times.append(time.perf_counter() - start)
            for sink in sinks:
                _drain(sink)
    finally:
        sender.close()
        for sink in sinks:
            sink.close()
    print(f"{args.model}: {flat.nbytes / 1e6:.1f} MB to {args.neighbours} neighbours in "
          f"{sender.chunk_bytes}-byte chunks: median {statistics.median(times) * 1000:.1f} ms, "
          f"best {min(times) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
