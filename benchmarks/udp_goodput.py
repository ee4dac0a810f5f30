"""UDP goodput: a 44.7 MB model (ResNet18 state) from one process to another over loopback.

Each trial: the sender hands the whole state to the UDP transport; the receiver's sync gather
returns when the last chunk is in, and it answers with a one-datagram REPLY through the same
transport. Goodput = model bytes / round-trip time. Reports
self-inflicted loss (chunks lost, the socket's SO_RXQ_OVFL drops, and the kernel's RcvbufErrors).

    python benchmarks/udp_goodput.py [--trials 20] [--chunk-bytes 0] [--rate-gbps 0]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from meshlearn.flat import FlatState
from meshlearn.layout import TensorLayout
from meshlearn.models import build_model
from meshlearn.transport.udp import (
    UdpSettings,
    UdpTransport,
    rcvbuf_errors,
)
from meshlearn.wire import Kind, Message


def _layout(name: str) -> tuple[FlatState, TensorLayout]:
    torch.manual_seed(0)
    flat = FlatState(build_model(name, (3, 32, 32), 10))
    return flat, TensorLayout.uniform(flat.ranges, flat.state.dtype)


def _settings(args) -> UdpSettings:
    return UdpSettings(chunk_bytes=args.chunk_bytes, rate_gbps=args.rate * 8 / 1e9)


def receiver(args, queue, back) -> None:
    flat, layout = _layout(args.model)
    transport = UdpTransport(1, layout=layout, settings=_settings(args))
    queue.put(transport.bind())
    transport.connect({0: back.get()})
    ok = 0
    for trial in range(args.trials):
        got = transport.gather(trial, [0], timeout=5.0)
        if 0 in got and got[0].chunks.missing == 0:
            ok += 1
        transport.recycle(got.values())
        transport.broadcast([0], Message(Kind.REPLY, 1, trial))
    queue.put((ok, transport.extra_stats()))
    transport.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--chunk-bytes", type=int, default=0, help="0 = the transport default for loopback")
    parser.add_argument("--rate-gbps", type=float, default=0.0, help="sender pacing in Gbit/s (0 = unpaced)")
    args = parser.parse_args()
    args.rate = args.rate_gbps * 1e9 / 8 if args.rate_gbps else float("inf")  # bytes per second
    flat, layout = _layout(args.model)
    ctx = mp.get_context("spawn")
    queue, back = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(args, queue, back))
    proc.start()
    transport = UdpTransport(0, layout=layout, settings=_settings(args))
    peer = queue.get()
    back.put(transport.bind())
    errors_before = rcvbuf_errors()
    transport.connect({1: peer})
    snapshot = flat.snapshot()
    times = []
    for trial in range(args.trials):
        start = time.perf_counter()
        transport.broadcast([1], Message(Kind.MODEL, 0, trial, 1, snapshot))
        transport.recv(5.0)
        times.append(time.perf_counter() - start)
    ok, stats = queue.get()
    proc.join()
    transport.close()
    best = statistics.median(times)
    print(f"{args.model}: {flat.nbytes / 1e6:.1f} MB in {args.chunk_bytes}-byte chunks, pacing "
          f"{'off' if args.rate == float('inf') else f'{args.rate_gbps} Gbit/s'}")
    print(f"median round trip {best * 1000:.1f} ms -> goodput {flat.nbytes / best / 1e9:.2f} GB/s "
          f"(best {flat.nbytes / min(times) / 1e9:.2f} GB/s)")
    print(f"complete models {ok}/{args.trials}; receiver: {stats}; kernel RcvbufErrors "
          f"+{rcvbuf_errors() - errors_before}")


if __name__ == "__main__":
    main()
