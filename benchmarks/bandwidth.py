"""One model exchange over a link of emulated bandwidth (``--net rate=...``), TCP and UDP.

Node 0 sends one model to node 1 over loopback (two transports in this process, real sockets),
each transport with the run's ``net`` (its rate limiting each link: TCP holds a message for its
time on the link on the receiving side, UDP paces each link's datagrams on the sending side). It
prints the seconds from the send to the whole model received, against bytes x 8 / rate. The
default model is ResNet-18 for 32 x 32 images (44.7 MB of state); at ``--rate 10mbit`` one
exchange should take 35.8 s.

    python3 benchmarks/bandwidth.py [--model resnet18] [--rate 10mbit] [--transports tcp udp] [--repeats 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from meshlearn.flat import FlatState
from meshlearn.layout import TensorLayout
from meshlearn.models import build_model
from meshlearn.netem import NetemSpec
from meshlearn.transport import TcpTransport
from meshlearn.transport.settings import TcpSettings
from meshlearn.transport.udp import UdpSettings, UdpTransport
from meshlearn.wire import Kind, Message

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.pairs import connected  # noqa: E402  (the tests' own pairing)


def transports(transport: str, flat: FlatState, net: NetemSpec, timeout: float):
    """Two transports of ``transport`` on loopback, handshaken, node 1 receiving from node 0."""
    if transport == "tcp":
        settings = TcpSettings(wait_timeout=timeout, linger=1)
        a, b = TcpTransport(0, settings=settings, netem=net), TcpTransport(1, settings=settings, netem=net)
    else:
        layout = TensorLayout.uniform(flat.ranges, flat.state.dtype)
        settings = UdpSettings(timeout=timeout)
        a, b = (UdpTransport(rank, layout=layout, settings=settings, netem=net) for rank in (0, 1))
    return connected(a, b)


def exchange(a, b, flat: FlatState, timeout: float) -> tuple[float, int]:
    """Seconds from node 0's send to node 1 holding its whole model, and the chunks missing (UDP)."""
    began = time.monotonic()
    a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, flat.snapshot()))
    got = b.gather(0, [0], timeout=timeout)
    seconds = time.monotonic() - began
    message = got.get(0)
    missing = -1 if message is None else (message.chunks.missing if message.chunks is not None else 0)
    return seconds, missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--rate", default="10mbit", help="each link's bandwidth, as in --net (rate=...)")
    parser.add_argument("--transports", nargs="+", default=["tcp", "udp"], choices=["tcp", "udp"])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    net = NetemSpec.parse(f"rate={args.rate}")
    torch.manual_seed(0)
    flat = FlatState(build_model(args.model, (3, 32, 32), 10))
    expected = flat.nbytes * 8 / net.rate
    timeout = 2 * expected + 30
    print(f"{args.model}: {flat.nbytes / 1e6:.1f} MB of state; at {args.rate}: {expected:.1f} s expected")
    for transport in args.transports:
        a, b = transports(transport, flat, net, timeout)
        try:
            for repeat in range(args.repeats):
                seconds, missing = exchange(a, b, flat, timeout)
                print(f"{transport} #{repeat + 1}: {seconds:.2f} s ({seconds / expected:.3f} of bytes x 8 / rate)"
                      + (f", {missing} chunks missing" if transport == "udp" else ""))
        finally:
            a.close()
            b.close()


if __name__ == "__main__":
    main()
