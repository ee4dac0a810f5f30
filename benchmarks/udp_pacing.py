"""UDP pacing across a slow uplink: one model-sized message over the real UDP transport, paced at
the link's rate and unpaced, and the share of its chunks each way loses.

A NAT lab (tests/helpers/natlab.py; root, ip, nft and tc) with one home, whose router's uplink (its
``wan`` end) is shaped with tc's ``tbf`` to ``--link``, with the small queue a home router keeps
(``--burst``, and ``--latency``: tbf drops a packet that would wait longer). In this process two
sealed UdpTransports, as network tasks run them: node 0 in the home (its socket opened in the
home's namespace, behind the router's NAT), node 1 on the public side. Node 0 sends one MODEL
message of ``--mb`` MB to node 1: once paced at ``--rate`` (what ``request --udp-rate`` sets), once
unpaced (UdpSettings' own rate, 16 Gbit/s, as simulations on one machine send). Node 1 gathers it,
and its transport counts the chunks that never came (``chunks_lost``). Each message is one JSON
line; the last line sums them up.

    sudo python benchmarks/udp_pacing.py [--link 10mbit] [--rate 9.5mbit] [--mb 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HANDSHAKE_S = 30.0  # seconds both transports have to hear each other (a safety net; well under one here)
# seconds node 1 waits for the rest of a message once node 0 handed its last datagram to the kernel:
# tbf drops whatever would wait more than --latency, so what has not come by then never will
DRAIN_S = 3.0


def shape_uplink(lab, link: str, burst: str, latency: str) -> None:
    """The home's uplink (its router's ``wan`` end) at ``link``, with a queue of ``burst`` plus
    ``latency`` of the link's rate (tc tbf)."""
    from helpers.natlab import _run

    _run(lab.command("r1", ["tc", "qdisc", "add", "dev", "wan", "root", "tbf", "rate", link, "burst", burst,
                            "latency", latency]))


def _transport(lab, ns: str, node: int, rate_gbps: float, key: bytes, floats: int):
    """A sealed UdpTransport of ``node``, its socket bound in namespace ``ns``."""
    import torch
    from helpers.natlab import call_in_netns

    from meshlearn.layout import TensorLayout
    from meshlearn.transport.settings import UdpSettings
    from meshlearn.transport.udp import UdpTransport
    from meshlearn.wire.sealed_datagram import DatagramSeal

    settings = UdpSettings(rate_gbps=rate_gbps, timeout=DRAIN_S, handshake_timeout=HANDSHAKE_S)
    layout = TensorLayout.uniform({"state": (0, floats)}, torch.float32)
    transport = UdpTransport(node, "0.0.0.0", 0, layout=layout, settings=settings, seal=DatagramSeal(key))
    call_in_netns(lab.ns_path(ns), transport.bind)
    return transport


def _connect(pair: dict, book: dict) -> None:
    """Both transports' handshakes at once (each waits until it has heard the other)."""
    failed: list[BaseException] = []

    def connect(node: int) -> None:
        try:
            pair[node].connect(book[node])
        except BaseException as exc:  # noqa: BLE001 - said in the caller's thread
            failed.append(exc)
    threads = [threading.Thread(target=connect, args=(node,)) for node in pair]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]


def one_message(lab, rate_gbps: float, mb: float, seed: int) -> dict:
    """One ``mb`` MB message from the home to the public side, node 0 pacing at ``rate_gbps``:
    its chunks, those node 1 never got, and the seconds node 0 took to send it."""
    import torch

    from meshlearn.wire import Kind, Message
    from meshlearn.wire.datagram import chunk_count

    floats = int(mb * 1e6 / 4)
    key = os.urandom(32)
    pair = {0: _transport(lab, "h1", 0, rate_gbps, key, floats), 1: _transport(lab, "pub", 1, rate_gbps, key, floats)}
    try:
        ports = {node: int(t.address.rpartition(":")[2]) for node, t in pair.items()}
        # node 1 answers node 0 at its router's public address (the NAT keeps the home's port)
        _connect(pair, {0: {1: f"udp://{lab.public_ip}:{ports[1]}"}, 1: {0: f"udp://{lab.router_ip(1)}:{ports[0]}"}})
        state = torch.randn(floats, generator=torch.Generator().manual_seed(seed))
        started = time.monotonic()
        pair[0].broadcast([1], Message(Kind.MODEL, 0, 0, 1, {"state": state}))
        sending = time.monotonic() - started
        pair[1].gather(0, [0], timeout=DRAIN_S)  # returns as soon as the message is whole
        chunks = chunk_count(floats * 4, pair[0].chunk_bytes)
        lost = pair[1].extra_stats()["chunks_lost"]
        return {"chunks": chunks, "lost": lost, "loss": lost / chunks, "send_s": round(sending, 3)}
    finally:
        for transport in pair.values():
            transport.close()


def measure(lab, rate_mbit: float, mb: float, reps: int) -> list[dict]:
    """``reps`` messages each way, paced at ``rate_mbit`` and unpaced, alternated: one row each."""
    from meshlearn.transport.settings import UdpSettings

    unpaced = UdpSettings.model_fields["rate_gbps"].default
    rows = []
    for rep in range(reps):
        for name, gbps in (("paced", rate_mbit / 1000), ("unpaced", unpaced)):
            row = {"rep": rep, "sending": name, "rate_mbit": gbps * 1000, "mb": mb,
                   **one_message(lab, gbps, mb, seed=rep)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def summary(rows: list[dict], args: argparse.Namespace, load: tuple[float, float, float]) -> dict:
    """The median loss each way, over the messages ``rows`` say, and what they ran on."""
    loss = {name: statistics.median(r["loss"] for r in rows if r["sending"] == name) for name in ("paced", "unpaced")}
    worst = {name: max(r["loss"] for r in rows if r["sending"] == name) for name in ("paced", "unpaced")}
    return {"summary": {"link": args.link, "burst": args.burst, "latency": args.latency, "rate": args.rate,
                        "mb": args.mb, "reps": args.reps, "median_loss": loss, "worst_loss": worst,
                        "load_before": load[0], "load_after": os.getloadavg()[0]}}


def _stop(signum, frame) -> None:
    raise SystemExit(f"udp_pacing: stopped by signal {signum}")  # the lab's ``with`` deletes its namespaces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="10mbit", help="the uplink's rate, in tc's units (default: 10mbit)")
    parser.add_argument("--burst", default="32kb", help="tbf's bucket (default: 32kb)")
    parser.add_argument("--latency", default="50ms", help="tbf's longest wait in its queue (default: 50ms)")
    parser.add_argument("--rate", default="9.5mbit", help="the paced sender's rate, as request --udp-rate takes it "
                        "(default: 9.5mbit)")
    parser.add_argument("--mb", type=float, default=4.0, help="the message's size in MB (default: 4)")
    parser.add_argument("--reps", type=int, default=3, help="messages each way (default: 3)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.natlab import NatLab, natlab_available

    from meshlearn.network.task.spec import udp_rate_mbit

    why = natlab_available()
    if why is not None:
        sys.exit(f"no NAT lab here: {why}")
    rate_mbit = udp_rate_mbit(args.rate)
    signal.signal(signal.SIGTERM, _stop)
    load = os.getloadavg()
    # internet: the router drops what comes unasked to itself, so node 1's first HELLOs (before node
    # 0's opened the NAT's mapping) leave no conntrack entry that would take the home's port
    with NatLab(homes=1, internet=True) as lab:
        shape_uplink(lab, args.link, args.burst, args.latency)
        rows = measure(lab, rate_mbit, args.mb, args.reps)
    print(json.dumps(summary(rows, args, load)), flush=True)


if __name__ == "__main__":
    main()
