"""The process launcher: a node that dies stops the whole run, names the node, and leaks nothing."""

import threading
import time

import pytest

from meshlearn.config import make_config
from meshlearn.sim.launcher import NodeFailure, _Launcher, prepare_run


def test_killed_node_stops_every_process_and_is_named(tmp_path):
    config = make_config({"nodes": 4, "topology": "ring", "iterations": 100_000, "test_after": 100_000,
                          "rounds": 1, "wait_timeout": 120, "output": str(tmp_path / "run")})
    graph, output = prepare_run(config)
    launcher = _Launcher(config, graph, output, progress=False)
    outcome: dict = {}

    def run():
        try:
            launcher.run()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (output / "logs" / "node_2.jsonl").is_file() or len(launcher.procs) < 4:
        assert time.monotonic() < deadline, "nodes never started"
        time.sleep(0.2)
    launcher.procs[2].kill()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), NodeFailure)
    assert "node 2" in str(outcome["error"])
    assert all(not proc.is_alive() for proc in launcher.procs.values())
