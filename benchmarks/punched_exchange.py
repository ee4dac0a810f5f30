"""A 44.7 MB model between two homes behind two NATs: over a punched path vs a direct link.

A NAT lab (tests/helpers/natlab.py; root, ip and nft) with two homes whose routers masquerade, and
an "internet" routing between the routers. In each home a node process: a sealed TcpTransport
(AES-GCM task key, as network tasks run it), node 0 sending one MODEL message (ResNet-18's 44.7 MB)
to node 1, which gathers it. Two ways to link them, alternated, fresh processes each run:

- direct: each router forwards the engine's port to its home (a port forward, as an operator would
  set up), and each node dials the other's router at that port;
- punched: no forward; each node's ``LinkPaths`` punches both links through both NATs (TCP
  simultaneous open, from fixed punching ports that the routers' masquerade keeps as they are),
  then hands them to the engines (``settle``): each DEALER connects from its punching port to the
  other's, each ROUTER meets it from there, and the link runs engine to engine, as a direct one;
- quic (``--quic``): as punched, but the TCP punch is made to fail at once, so ``LinkPaths`` punches
  UDP from fixed ports and carries both links over one QUIC connection (certificates pinned: each
  node says its fingerprint, the orchestrator hands it to the other).

A time runs from the sender's ``send`` to the receiver's ``gather`` returning (both clocks are this
machine's CLOCK_MONOTONIC). One warm-up message, then ``--reps`` timed; a run's figure is their median.

    sudo python benchmarks/punched_exchange.py [--pairs 3] [--reps 5] [--mb 44.7] [--quic] [--rate 1gbit]

``--rate`` shapes each home's uplink and downlink (a ``tbf`` qdisc on both ends of its router's
public link), as a home connection is: the links then cost what they would, instead of the
unlimited veth pairs, on which the paths' fixed costs weigh most.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {0: 47000, 1: 47001}  # each node's engine port (the same number at its router, forwarded or not)
OUT, IN, UDP = {0: 47100, 1: 47101}, {0: 47200, 1: 47201}, {0: 47300, 1: 47301}  # each node's punching ports
TIMEOUT = 120.0


def node(index: int, path: str, key_hex: str, reps: int, mb: float) -> None:
    """One node, in its home: bind, link to the other, send (0) or gather (1), say the times."""
    import socket

    import torch

    from meshlearn.flat import SEGMENT_BYTES
    from meshlearn.network.channel.punch import PunchMemory, PunchResult, punch_socket
    from meshlearn.network.protocol.providerapi import PunchPorts
    from meshlearn.network.provider.linkpaths import LinkPaths
    from meshlearn.network.provider.natside import QuicSockets
    from meshlearn.transport import TcpTransport
    from meshlearn.transport.settings import TcpSettings
    from meshlearn.wire import Kind, Message
    from meshlearn.wire.sealed import FrameSeal

    other = 1 - index
    router = {0: "198.18.1.2", 1: "198.18.2.2"}
    transport = TcpTransport(index, "0.0.0.0", ENGINE[index], seal=FrameSeal(bytes.fromhex(key_hex)),
                             settings=TcpSettings(handshake_timeout=60, wait_timeout=60, linger=1))
    transport.bind()
    book = {other: f"tcp://{router[other]}:{ENGINE[other]}"}
    paths = held = None
    if path in ("punched", "quic"):
        held = [punch_socket("0.0.0.0", OUT[index]), punch_socket("0.0.0.0", IN[index])]
        quic = QuicSockets()
        pins = {index: quic.certificate.fingerprint.hex()}
        if path == "quic":
            quic.sockets[other] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            quic.sockets[other].bind(("0.0.0.0", UDP[index]))
            print(f"pin {pins[index]}", flush=True)
            pins[other] = sys.stdin.readline().strip()
        ports = {i: PunchPorts(host=router[i], out_port=OUT[i], in_port=IN[i], behind_nat=True,
                               **({"quic_pin": pins[i], "udp_ports": {str(1 - i): UDP[i]}} if path == "quic" else {}))
                 for i in (0, 1)}

        def no_tcp(local, peer, deadline, clock, cancelled=None):
            return PunchResult(None, 0, "not tried: this run measures QUIC")
        paths = LinkPaths(index, "0.0.0.0", ENGINE[index], ports[index], PunchMemory(), quic,
                          **({"punch": no_tcp} if path == "quic" else {}))
        book = paths.route(book, {0: "node0", 1: "node1"}, {other: ports[other]})
        book = paths.settle(book).give(transport)  # a punched link: each engine connects between the punched ports
    transport.connect(book)
    print("ready", flush=True)
    torch.manual_seed(0)
    state = torch.randn(int(mb * 1e6 / 4))
    tensors = {f"state.{i}": part for i, part in enumerate(torch.split(state, SEGMENT_BYTES // 4))}
    for iteration in range(reps + 1):
        if index == 0:
            sys.stdin.readline()  # the orchestrator's go: the receiver said the last one came
            print(f"sent {time.perf_counter()!r}", flush=True)
            transport.send(1, Message(Kind.MODEL, 0, iteration, 1, tensors))
        else:
            got = transport.gather(iteration, [0], timeout=TIMEOUT)
            print(f"got {time.perf_counter()!r}" if got else "lost", flush=True)
    if paths is not None:
        print(f"links {paths.report()}", flush=True)
    if index == 0:
        sys.stdin.readline()
    transport.close()
    if paths is not None:
        paths.close()
    for sock in held or []:
        sock.close()


def _line(proc: subprocess.Popen, prefix: str) -> str:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a node ended before saying {prefix!r} (rc {proc.wait()})")
        if line.startswith(prefix):
            return line[len(prefix):].strip()


def one_run(lab, path: str, reps: int, mb: float) -> float:
    """The median one-way time of ``reps`` messages over ``path`` (fresh node processes)."""
    key = os.urandom(32).hex()
    procs = [subprocess.Popen(lab.command(f"h{i + 1}", [sys.executable, __file__, "--node", str(i), "--path", path,
                                                       "--key", key, "--reps", str(reps), "--mb", str(mb)]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for i in (0, 1)]
    try:
        if path == "quic":  # each node's certificate fingerprint to the other
            pins = [_line(proc, "pin ") for proc in procs]
            for proc, pin in zip(procs, reversed(pins)):
                proc.stdin.write(pin + "\n")
                proc.stdin.flush()
        for proc in procs:
            _line(proc, "ready")
        sender, receiver = procs
        times = []
        for iteration in range(reps + 1):
            sender.stdin.write("go\n")
            sender.stdin.flush()
            sent = float(_line(sender, "sent "))
            got = float(_line(receiver, "got "))
            if iteration:
                times.append(got - sent)
        if path != "direct":
            links = _line(receiver, "links ")
            assert f"'{path}'" in links, links
        sender.stdin.write("done\n")
        sender.stdin.flush()
        for proc in procs:
            proc.wait(timeout=60)
        return statistics.median(times)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def forward_engine_ports(lab) -> None:
    """Each router forwards its home's engine port (the direct link's setup)."""
    from helpers.natlab import _run

    for i in (1, 2):
        port = ENGINE[i - 1]
        _run(lab.command(f"r{i}", ["nft", "-f", "-"]), input=(
            "table ip forward_engine {\n"
            " chain prerouting {\n  type nat hook prerouting priority dstnat; policy accept;\n"
            f"  iifname \"wan\" tcp dport {port} dnat to 10.{i}.0.2:{port}\n }}\n}}\n"))
        _run(lab.command(f"r{i}", ["nft", "insert", "rule", "ip", "natlab", "forward", "iifname", "wan",
                                   "ct", "status", "dnat", "accept"]))


def shape_links(lab, rate: str) -> None:
    """Each home's router's public link at ``rate`` both ways (tc tbf; netem is not needed)."""
    from helpers.natlab import _run

    for i in (1, 2):
        for ns, dev in ((f"r{i}", "wan"), ("pub", f"r{i}")):
            _run(lab.command(ns, ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                                  "burst", "512kb", "latency", "50ms"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mb", type=float, default=44.7)
    parser.add_argument("--quic", action="store_true", help="time QUIC over a punched UDP path instead of TCP")
    parser.add_argument("--rate", help="shape each home's link to this rate, e.g. 1gbit (default: unlimited veth)")
    parser.add_argument("--node", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node is not None:
        node(args.node, args.path, args.key, args.reps, args.mb)
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.natlab import NatLab, natlab_available

    why = natlab_available()
    if why is not None:
        sys.exit(f"no NAT lab here: {why}")
    ratios = []
    with NatLab(homes=2, internet=True) as lab:
        forward_engine_ports(lab)
        if args.rate:
            shape_links(lab, args.rate)
        way = "quic" if args.quic else "punched"
        for pair in range(args.pairs):
            direct = one_run(lab, "direct", args.reps, args.mb)
            punched = one_run(lab, way, args.reps, args.mb)
            ratios.append(punched / direct)
            print(f"pair {pair + 1}: direct {direct * 1e3:.1f} ms  {way} {punched * 1e3:.1f} ms  "
                  f"ratio {ratios[-1]:.2f}", flush=True)
    print(f"{way} / direct: median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}) "
          f"over {args.pairs} pairs, {args.mb} MB, {args.reps} messages a run"
          + (f", links shaped to {args.rate}" if args.rate else ", unlimited veth links"))


if __name__ == "__main__":
    main()
