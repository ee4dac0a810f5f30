"""Runs attacked by an outsider without the secret (as in `simulate`): a connection that claims a
neighbour's identity, a flood of models for future iterations, messages whose shapes crash a
naive decoder. Each run must finish with the accuracy of an unattacked run on the same seed, and
this process (the nodes; the attacker runs in its own) must not grow by more than 50 MB under attack."""

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from meshlearn.config import make_config
from meshlearn.node import build_node
from meshlearn.sim.inprocess import run_threads
from meshlearn.topology import build_topology

ATTACKER = Path(__file__).parent / "helpers" / "attacker.py"
FLOOD = 3000  # models (TCP) or datagrams (UDP) of future iterations: hundreds of MB if all were kept
RSS_LIMIT_MB = 50


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class _PeakRss:
    """The process's largest resident size from ``start()`` on, sampled every 10 ms."""

    def __init__(self):
        self.base = self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        self.base = self.peak = _rss_mb()
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_mb())

    def stop(self) -> float:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, _rss_mb())
        return self.peak - self.base


@pytest.fixture
def attacker():
    """Start the attacker process with arguments; returns once it says its attack is sent."""
    procs = []

    def start(*args) -> str:
        proc = subprocess.Popen([sys.executable, str(ATTACKER), *map(str, args)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline().strip()
        assert line.startswith("done"), f"the attacker failed (exit {proc.poll()})"
        return line

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _config(algorithm: str, transport: str):
    return make_config({"nodes": 4, "topology": "ring", "algorithm": algorithm, "transport": transport,
                        "model": "mlp", "iterations": 40, "rounds": 2, "test_after": 40, "lr": 0.05, "seed": 4,
                        "wait_timeout": 20, "udp_timeout": 2.0, "fetch_timeout": 1.0, "handshake_timeout": 30})


def _run(config, on_bound=None, after_first_iteration=None) -> tuple[float, list]:
    """Run the nodes in this process; return their mean final accuracy and the nodes."""
    graph = build_topology(config.topology, config.nodes, config.seed)
    nodes = [build_node(config, rank, graph) for rank in range(config.nodes)]
    if after_first_iteration is not None:
        def hook(node, iteration, _record):
            if iteration == 0:
                after_first_iteration(node)

        nodes[0].hooks.append(hook)
    summaries = run_threads(nodes, timeout=600, on_bound=on_bound)
    accuracies = [s["metrics"]["accuracy"] for s in summaries.values() if s["metrics"]]
    assert accuracies
    return sum(accuracies) / len(accuracies), nodes


@pytest.fixture(scope="module")
def clean_accuracy():
    cache = {}

    def get(algorithm, transport):
        if (algorithm, transport) not in cache:
            cache[algorithm, transport] = _run(_config(algorithm, transport))[0]
        return cache[algorithm, transport]

    return get


def test_a_dpsgd_run_over_tcp_survives_a_hijacker_a_flood_of_future_models_and_a_crashing_shape(
        clean_accuracy, attacker):
    expected = clean_accuracy("dpsgd", "tcp")
    rss = _PeakRss()

    def attack(node):  # node 0, after its first iteration: its neighbours are connected
        rss.start()
        attacker("tcp", node.transport.address, node.flat.state.numel(), FLOOD)

    accuracy, nodes = _run(_config("dpsgd", "tcp"), after_first_iteration=attack)
    growth = rss.stop()
    stats = nodes[0].transport.stats
    assert stats.malformed_dropped >= 1  # the crashing shape arrived, and was refused
    assert stats.overflow_dropped > 0  # the flood arrived, and was not all kept
    assert accuracy == pytest.approx(expected, abs=0.02)
    assert growth < RSS_LIMIT_MB, f"grew {growth:.0f} MB under attack"


def test_a_gossip_run_survives_squatted_identities_and_crashing_requests(clean_accuracy, attacker):
    expected = clean_accuracy("gossip", "tcp")
    rss = _PeakRss()

    def squat(book):  # before any node connects
        rss.start()
        attacker("squat", *book.values())

    accuracy, nodes = _run(_config("gossip", "tcp"), on_bound=squat)
    growth = rss.stop()
    assert sum(node.transport.stats.malformed_dropped for node in nodes) >= len(nodes)  # every crashing request
    # gossip's timing varies from run to run, more on a loaded machine: with three busy loops on this
    # 2-core VM a run under attack ended at 0.719 against a clean 0.790 (and the clean run itself
    # moves 0.735-0.790), so a drop beyond 0.1 is what says the squatters hurt it
    assert accuracy > expected - 0.1, (accuracy, expected)
    assert growth < RSS_LIMIT_MB, f"grew {growth:.0f} MB under attack"


def test_a_dpsgd_run_over_udp_survives_spoofed_future_iterations(clean_accuracy, attacker):
    expected = clean_accuracy("dpsgd", "udp")
    rss = _PeakRss()

    def attack(node):
        rss.start()
        attacker("udp", node.transport.address.removeprefix("udp://"), node.flat.nbytes, node.transport.chunk_bytes,
                 FLOOD)

    accuracy, nodes = _run(_config("dpsgd", "udp"), after_first_iteration=attack)
    growth = rss.stop()
    assert nodes[0].transport.stats.overflow_dropped > 0
    assert accuracy == pytest.approx(expected, abs=0.02)
    assert growth < RSS_LIMIT_MB, f"grew {growth:.0f} MB under attack"
