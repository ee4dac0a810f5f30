"""A network task over TCP and over sealed UDP, side by side, on slow lossy links between providers.

A bootstrap and ``--providers`` providers on loopback, each provider started with
``MESHLEARN_TEST_NET`` (the emulated network on its task engines' links, ``--net``'s syntax; the
control channel is not emulated), then the same D-PSGD task requested once per transport
(``meshlearn request --transport T``), alternating for ``--repeats``. It prints each task's
training seconds (the same iterations in each), the UDP / TCP ratio, and the accuracies.

Over TCP, loss is modelled as the retransmission delays it would cost (``netem.retransmit_delays``:
a lower bound; this machine has no netem qdisc), delay and jitter per message; over UDP, datagrams
are lost and delayed one by one and a provider averages what came within ``--udp-timeout``.

    python3 benchmarks/network_udp.py [--net loss=20%,corr=25%,delay=200ms,jitter=50ms] [--providers 3]
        [--epochs 3] [--udp-timeout 0.4] [--model mlp] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECRET = "benchmark-network-secret"


def free_port() -> int:
    """A free port P on loopback whose P + 1 is free too (the bootstrap's relay takes P + 1)."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free pair of neighbouring ports")


class Services:
    """The meshlearn processes of one benchmark, their logs in ``folder``; all killed at the end."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "MESHLEARN_SECRET": SECRET, "MESHLEARN_HOME": str(folder / "home"),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

    def start(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "meshlearn", *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**self.env, **(env or {})}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait_for(self, name: str, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, (self.folder / f"{name}.log").read_text())
            if found:
                return found
            time.sleep(0.1)
        raise RuntimeError(f"{name} never printed {pattern!r}: see {self.folder / name}.log")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--net", default="loss=20%,corr=25%,delay=200ms,jitter=50ms")
    parser.add_argument("--providers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--udp-timeout", type=float, default=0.4)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="network-udp-"))
    services = Services(folder)
    try:
        port = free_port()
        services.start("bootstrap", "bootstrap", "--port", str(port), "--state", str(folder / "registry.sqlite"),
                       "--host", "127.0.0.1", "--relay-port", "0")
        bootstrap = services.wait_for("bootstrap", r"other machines give --bootstrap (\S+)").group(1)
        for i in range(args.providers):
            services.start(f"p{i}", "provider", "--bootstrap", bootstrap, "--id", f"p{i}", "--host", "127.0.0.1",
                           "--workdir", str(folder / f"p{i}"), env={"MESHLEARN_TEST_NET": args.net})
        for i in range(args.providers):
            services.wait_for(f"p{i}", "registered with")
        print(f"{args.providers} providers, links: {args.net}; D-PSGD, {args.model} on digits, {args.epochs} epochs")
        seconds: dict[str, list[float]] = {"tcp": [], "udp": []}
        for repeat in range(args.repeats):
            for transport in ("tcp", "udp"):
                name = f"{transport}-{repeat + 1}"
                proc = services.start(name, "request", "--bootstrap", bootstrap, "--data", "digits", "--model",
                                      args.model, "--lr", "0.05", "--batch-size", "16", "--algorithm", "dpsgd",
                                      "--transport", transport, "--udp-timeout", str(args.udp_timeout),
                                      "--epochs", str(args.epochs), "--providers", str(args.providers),
                                      "--aggregate-every", "5", "--wait", "30", "--output", str(folder / name))
                if proc.wait(timeout=3600) != 0:
                    raise RuntimeError(f"the {transport} task failed: see {folder / name}.log")
                metrics = json.loads((folder / name / "metrics.json").read_text())
                seconds[transport].append(metrics["training_time"])
                print(f"{name}: training {metrics['training_time']:.1f} s, accuracy {metrics['accuracy']:.4f}, "
                      f"lost {metrics['lost']}", flush=True)
        tcp, udp = (sum(values) / len(values) for values in (seconds["tcp"], seconds["udp"]))
        print(f"UDP / TCP training seconds: {udp / tcp:.3f} (means {udp:.1f} / {tcp:.1f} s); logs in {folder}")
    finally:
        services.stop()


if __name__ == "__main__":
    main()
