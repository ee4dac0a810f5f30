"""Strangers against the network's services during a task (issue 32 items 7 and 8): connections
held to a relayed provider's public port and to the relay's agent port, and a flood of dashboard
connections, while the bootstrap may hold only 1,024 open files. The task must complete within
twice its clean time, and the relay must answer ``KEY`` throughout. Real processes on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.netproc import free_port

from meshlearn.network.channel.probes import fetch_key_line

FLOODER = Path(__file__).parent / "helpers" / "flooder.py"
TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "16", "--algorithm", "leader",
        "--epochs", "8", "--providers", "2", "--aggregate-every", "5"]


def _start_network(procs, dashboard: int) -> tuple[str, str, str]:
    """A bootstrap that may hold 1,024 open files, with a dashboard; provider p0 reachable, p1
    behind the relay (it announces an address the bootstrap does not dial). Returns the
    bootstrap's address, the relay's agent address and p1's public (relayed) address."""
    port = free_port()
    procs.start("bootstrap", "bootstrap", "--port", str(port), "--state", str(procs.folder / "registry.sqlite"),
                "--relay-port", "0", "--dashboard", str(dashboard), prefix=("prlimit", "--nofile=1024:1024"))
    bootstrap = procs.wait_for("bootstrap", r"other machines give --bootstrap (\S+)").group(1)
    relay_port = procs.wait_for("bootstrap", r"relay on port (\d+)").group(1)
    relay = f"127.0.0.1:{relay_port}"
    procs.start("p0", "provider", "--bootstrap", bootstrap, "--id", "p0", "--workdir", str(procs.folder / "p0"))
    procs.start("p1", "provider", "--bootstrap", bootstrap, "--id", "p1", "--workdir", str(procs.folder / "p1"),
                "--advertise", "192.0.2.7")
    procs.wait_for("p0", "registered with")
    public = procs.wait_for("p1", r"reached at (\S+)\)?").group(1).rstrip(")")
    return bootstrap, relay, public


def _task(procs, name: str, bootstrap: str) -> float:
    """Run the task; its wall time in seconds."""
    start = time.monotonic()
    proc = procs.start(name, "request", "--bootstrap", bootstrap, "--output", str(procs.folder / name), *TASK)
    assert proc.wait(timeout=300) == 0, procs.log(name)
    return time.monotonic() - start


class _KeyWatch:
    """Asks the relay for the bootstrap's key every half second, from a thread, and counts."""

    def __init__(self, relay: str):
        self.relay, self.asked, self.failures = relay, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.asked += 1
            try:
                fetch_key_line(self.relay, timeout=5)
            except Exception as exc:  # noqa: BLE001 - every failure is what the test counts
                self.failures.append(repr(exc))

    def __enter__(self) -> "_KeyWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


# slow (about 45 s): the default run keeps each listener's own limits (tests/test_listener_limits.py: out of
# descriptors, one left) and the dashboard's flood of idle connections (tests/test_dashboard.py)
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux) to lower the file limit")
def test_a_task_completes_and_key_answers_while_strangers_hold_connections_and_flood_the_dashboard(procs):
    dashboard = free_port()
    bootstrap, relay, public = _start_network(procs, dashboard)
    clean = _task(procs, "clean", bootstrap)
    host, port = public.rsplit(":", 1)
    relay_host, relay_port = relay.rsplit(":", 1)
    flooder = subprocess.Popen(
        [sys.executable, str(FLOODER), f"silent:{host}:{port}:50", f"greeting:{host}:{port}:50",
         f"silent:{relay_host}:{relay_port}:300", f"http:127.0.0.1:{dashboard}:1100"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        held = flooder.stdout.readline()
        assert held.startswith("holding"), held
        with _KeyWatch(relay) as keys:
            attacked = _task(procs, "attacked", bootstrap)
        assert keys.asked >= 4 and keys.failures == [], keys.failures
    finally:
        flooder.stdin.close()
        flooder.kill()
        flooder.wait(10)
    print(f"clean {clean:.1f} s, attacked {attacked:.1f} s, KEY answered {keys.asked} of {keys.asked}")
    assert attacked <= 2 * clean + 5, (clean, attacked)  # the acceptance bound, with 5 s for a loaded machine
    scores = [json.loads((procs.folder / name / "metrics.json").read_text())["accuracy"] for name in ("clean", "attacked")]
    assert min(scores) > 0.8, scores
    assert procs.procs["bootstrap"].poll() is None
