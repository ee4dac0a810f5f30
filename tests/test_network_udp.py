"""A network task over sealed UDP: `meshlearn request --transport udp`, a bootstrap and providers as
separate processes on loopback, every datagram captured off the wire (a raw socket on lo, root)."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading

import numpy as np
import pytest
import torch
from helpers.hold import MODELS, Hold
from helpers.netproc import Processes, start_network
from helpers.pairs import connected

from meshlearn.flat import FlatState
from meshlearn.layout import TensorLayout
from meshlearn.models import build_model
from meshlearn.transport.udp import UdpSettings, UdpTransport
from meshlearn.wire import Kind, Message
from meshlearn.wire.datagram import HEADER_SIZE, MAGIC
from meshlearn.wire.sealed_datagram import DatagramSeal

TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "16"]
ETH_P_ALL = 0x0003


def weight_like(payload: bytes) -> float:
    """The share of a payload's 4-byte words that read as a float32 a model holds (finite, 1e-4 <
    |x| < 4): about 1 for a chunk of weights in the clear, about 0.1 for random (sealed) bytes."""
    words = np.frombuffer(payload[:len(payload) // 4 * 4], dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        magnitude = np.abs(words)
        return float(np.mean(np.isfinite(words) & (magnitude > 1e-4) & (magnitude < 4))) if len(words) else 0.0


class LoopbackCapture:
    """Every meshlearn datagram on lo while it runs (an AF_PACKET socket: root only), as UDP payloads."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.datagrams: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoopbackCapture:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame, address = self.sock.recvfrom(1 << 17)
            except TimeoutError:
                continue
            if address[2] == socket.PACKET_OUTGOING:  # each packet on lo is seen going out and coming in
                continue
            ip = frame[14:]  # after lo's (zeroed) Ethernet header
            if len(ip) < 28 or ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_UDP:
                continue
            payload = ip[(ip[0] & 0x0F) * 4 + 8:]
            if payload[:4] == MAGIC:
                self.datagrams.append(bytes(payload))


def test_the_weight_check_tells_a_model_in_the_clear_from_a_sealed_one():
    torch.manual_seed(0)
    flat = FlatState(build_model("mlp", (1, 8, 8), 10))
    layout = TensorLayout.uniform(flat.ranges, flat.state.dtype)
    for seal, clear in ((None, True), (DatagramSeal(os.urandom(32)), False)):
        a, b = connected(*(UdpTransport(rank, layout=layout, settings=UdpSettings(chunk_bytes=4000), seal=seal)
                           for rank in (0, 1)))
        sent: list[bytes] = []
        send = a.sender._send
        a.sender._send = lambda pieces, addr: sent.append(b"".join(bytes(p) for p in pieces)) or send(pieces, addr)
        try:
            a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, flat.snapshot()))
            assert b.gather(0, [0], timeout=10)[0].chunks.missing == 0
            shares = [weight_like(d[HEADER_SIZE:]) for d in sent if d[5] == Kind.MODEL]
            assert shares and (min(shares) > 0.9 if clear else max(shares) < 0.3), shares
        finally:
            a.close()
            b.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="capturing packets on lo needs root")
def test_a_dpsgd_task_over_sealed_udp_trains_and_no_datagram_carries_a_model_in_the_clear(procs: Processes):
    bootstrap, ids = start_network(procs, 3)
    with LoopbackCapture() as capture:
        proc = procs.start("req", "request", "--bootstrap", bootstrap, "--output", str(procs.folder / "req"), *TASK,
                           "--algorithm", "dpsgd", "--transport", "udp", "--epochs", "3", "--providers", "3",
                           "--aggregate-every", "5", "--wait", "0")
        proc.wait(timeout=240)
    out = procs.log("req")
    assert proc.returncode == 0, out
    metrics = json.loads((procs.folder / "req" / "metrics.json").read_text())
    assert metrics["algorithm"] == "dpsgd" and metrics["lost"] == [] and metrics["accuracy"] > 0.5
    models = [d for d in capture.datagrams if d[5] == Kind.MODEL and len(d) > HEADER_SIZE + 256]
    senders = {struct.unpack_from("<I", d, 8)[0] for d in models}
    assert len(models) > 30 and senders == {0, 1, 2}  # every provider's models went over UDP ...
    assert max(weight_like(d[HEADER_SIZE:]) for d in models) < 0.3  # ... and none of them in the clear


def test_a_task_asking_udp_for_an_algorithm_that_needs_every_message_is_refused_in_one_line(procs: Processes):
    proc = procs.start("bad", "request", "--bootstrap", "127.0.0.1:9", "--data", "digits", "--algorithm", "leader",
                       "--transport", "udp")
    assert proc.wait(timeout=60) == 2, procs.log("bad")
    out = procs.log("bad").strip()
    assert "transport udp carries algorithms that average around lost datagrams" in out
    assert len(out.splitlines()) == 1 and "Traceback" not in out


def _udp_ports(pid: int) -> set[int]:
    """The UDP ports process ``pid`` has bound (its sockets' inodes, looked up in /proc/net/udp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    with open("/proc/net/udp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.mark.slow  # the D-PSGD task over sealed UDP and test_udp's fuzzed datagrams run in the default run
def test_a_task_over_sealed_udp_keeps_training_while_its_ports_are_fuzzed(procs: Processes):
    """A bounded loop of random and crafted datagrams at every provider's engine port while the task
    runs: the task ends as a clean one does (0.88 here), and the providers' memory stays flat."""
    import random
    import time

    from helpers.waiting import wait_until

    from meshlearn.wire.datagram import ChunkHeader, pack_header

    hold = Hold(procs.folder, 26)  # round 5 of 24: the first datagrams come while the task surely runs
    bootstrap, ids = start_network(procs, 3, provider_args=("--models-module", MODELS), provider_env=hold.env)
    pids = [procs.procs[pid].pid for pid in ids]
    before = {pid: _udp_ports(pid) for pid in pids}
    proc = procs.start("req", "request", "--bootstrap", bootstrap, "--output", str(procs.folder / "req"), *TASK,
                       "--model", "held-mlp", "--models-module", MODELS,
                       "--algorithm", "dpsgd", "--transport", "udp", "--epochs", "4", "--providers", "3",
                       "--aggregate-every", "5", "--wait", "0")
    hold.wait_held(procs, ids)
    assert wait_until(lambda: all(_udp_ports(pid) - before[pid] for pid in pids), timeout=60), procs.log("req")
    targets = [("127.0.0.1", port) for pid in pids for port in _udp_ports(pid) - before[pid]]
    rss = [_rss_mb(pid) for pid in pids]
    rng = random.Random(1)
    crafted = [pack_header(ChunkHeader(Kind.MODEL, rank, 1, 0, 1, 4000, 2, 1000)) for rank in range(3)]
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as attacker:
        while (proc.poll() is None or hold.up) and sent < 6000:
            if hold.up and sent >= 600:  # the first 600 while the providers wait at their step (their engines
                hold.release()  # listening), the rest while they train on
            for target in targets:
                choice = rng.random()
                if choice < 0.4:  # random bytes
                    datagram = os.urandom(rng.randrange(1, 3000))
                elif choice < 0.8:  # a header that parses, a body sealed with no key of the task
                    datagram = crafted[rng.randrange(3)] + os.urandom(1000 + 28)
                else:  # a header cut short
                    datagram = crafted[rng.randrange(3)][:rng.randrange(1, 48)]
                attacker.sendto(datagram, target)
                sent += 1
            if sent % 300 == 0:
                time.sleep(0.01)
    grown = [_rss_mb(pid) - mb for pid, mb in zip(pids, rss) if os.path.exists(f"/proc/{pid}")]
    hold.release_all()
    assert proc.wait(timeout=240) == 0, procs.log("req")
    metrics = json.loads((procs.folder / "req" / "metrics.json").read_text())
    assert metrics["lost"] == [] and metrics["accuracy"] > 0.8, metrics["accuracy"]
    assert all(growth < 60 for growth in grown), grown
