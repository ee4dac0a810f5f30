"""What carrying an engine's ZeroMQ connection over a QUIC path (network/channel/quicpath.py) costs
against the plain TCP connection it stands in for: one 44.7 MB message (ResNet-18's parameters)
from a DEALER to a ROUTER in another process, on loopback.

Each run starts both sides afresh (the QUIC one: a UDP socket each, ephemeral certificates whose
fingerprints go through a pipe, the path's handshake, a warm-up message), then times one message:
from ``send`` to the ROUTER's one-byte reply. Runs alternate QUIC and TCP in pairs, the order
swapped every pair; printed: each pair's ratio (QUIC time / TCP time), their median and range.

    python benchmarks/quic_path.py [--mb 44.7] [--pairs 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time

import zmq

from meshlearn.network.channel.quicpath import PathCertificate, QuicPath

WAIT = 120.0  # seconds a side waits for the other (setup, or the message)


def _udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def _router_side(pipe, quic: bool) -> None:
    """The receiving engine (a ROUTER), behind the path's server side when ``quic``."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    path = None
    if quic:
        sock, own = _udp(), PathCertificate.generate()
        pipe.send((sock.getsockname(), own.fingerprint))
        peer, pin = pipe.recv()
        path = QuicPath(sock, peer, "server", own, pin)
        path.expose_local(port)
        path.start()
    pipe.send(port)
    for _ in range(2):  # the warm-up, then the message
        sender, _message = router.recv_multipart(copy=False)
        router.send_multipart([sender.bytes, b"k"])
    pipe.recv()  # the sender is done
    if path is not None:
        path.close()
    ctx.destroy(0)


def one_run(payload: bytes, quic: bool) -> float:
    """Seconds from sending ``payload`` to the reply, over a fresh QUIC path or TCP connection."""
    mine, theirs = mp.Pipe()
    proc = mp.Process(target=_router_side, args=(theirs, quic))
    proc.start()
    path = None
    ctx = zmq.Context()
    try:
        if quic:
            sock, own = _udp(), PathCertificate.generate()
            peer, pin = mine.recv()
            mine.send((sock.getsockname(), own.fingerprint))
            path = QuicPath(sock, peer, "client", own, pin)
            local = path.expose_local(None)
            path.start()
            mine.recv()  # the far side's path is up
        else:
            local = mine.recv()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{local}")
        dealer.send(b"warm-up")
        dealer.recv()
        start = time.perf_counter()
        dealer.send(payload, copy=False)
        dealer.recv()
        seconds = time.perf_counter() - start
        mine.send("done")
    finally:
        ctx.destroy(0)
        if path is not None:
            path.close()
        proc.join(WAIT)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=44.7, help="message size in MB (default: 44.7, ResNet-18)")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs, QUIC and TCP alternated (default: 3)")
    args = parser.parse_args()
    mp.set_start_method("fork")
    payload = os.urandom(int(args.mb * 1e6))
    print(f"load at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; {args.mb} MB message")
    ratios = []
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        seconds = {quic: one_run(payload, quic) for quic in order}
        ratios.append(seconds[True] / seconds[False])
        print(f"pair {pair + 1}: QUIC path {seconds[True]:.2f} s ({args.mb / seconds[True]:.1f} MB/s), "
              f"TCP {seconds[False]:.3f} s ({args.mb / seconds[False]:.0f} MB/s), ratio {ratios[-1]:.1f}")
    print(f"median ratio QUIC/TCP {statistics.median(ratios):.1f} (range {min(ratios):.1f}-{max(ratios):.1f}); "
          f"load at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
