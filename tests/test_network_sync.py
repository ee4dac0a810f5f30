"""Synchronous aggregation and FedAvg as network tasks (issue 34 item 7): real processes on loopback."""

from __future__ import annotations

import json

import pytest
from helpers.hold import MODELS, Hold
from helpers.netproc import Processes, start_network
from helpers.scoring import score_result

TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "16", "--seed", "5"]


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    """Three providers on loopback."""
    processes = Processes(tmp_path_factory.mktemp("sync"))
    try:
        bootstrap, ids = start_network(processes, 3)
        yield processes, bootstrap, ids
    finally:
        processes.stop_all()


def _request(procs: Processes, name: str, bootstrap: str, *args: str) -> dict:
    proc = procs.start(name, "request", "--bootstrap", bootstrap, "--output", str(procs.folder / name), *TASK, *args)
    assert proc.wait(timeout=240) == 0, procs.log(name)
    metrics = json.loads((procs.folder / name / "metrics.json").read_text())
    assert score_result(procs.folder / name) == pytest.approx(metrics["accuracy"], abs=1e-9)
    return metrics


@pytest.mark.slow  # 30 s; quick sibling: the FedAvg task below, the same synchronous leader, a fraction a cycle
def test_a_synchronous_leader_task_waits_every_cycle_for_every_provider(network):
    procs, bootstrap, ids = network
    metrics = _request(procs, "req-sync", bootstrap, "--algorithm", "leader", "--leader-sync", "true",
                       "--epochs", "3", "--providers", "3", "--aggregate-every", "10")
    assert metrics["algorithm"] == "leader" and metrics["lost"] == [] and sorted(metrics["providers"]) == ids
    # every cycle's aggregate took every provider's model (the final one is the finish's, of every final model)
    models = metrics["cycle_models"]
    assert list(models) == [str(c) for c in range(len(models))] and len(models) >= 6
    assert set(models.values()) == {3}
    assert metrics["accuracy"] > 0.5


def test_a_fedavg_task_completes_and_learns(network):
    procs, bootstrap, ids = network
    metrics = _request(procs, "req-fedavg", bootstrap, "--algorithm", "fedavg", "--fedavg-fraction", "0.6",
                       "--epochs", "3", "--providers", "3", "--aggregate-every", "10")
    assert metrics["algorithm"] == "fedavg" and metrics["lost"] == [] and sorted(metrics["providers"]) == ids
    models = metrics["cycle_models"]
    assert models and set(models.values()) == {2}  # two of the three providers' models each cycle
    assert metrics["accuracy"] > 0.5


# about 30 s each: fedavg (the same leader, with its fraction) runs with -m slow
# test_network_join kills a synchronous task's leader (and takes in a provider in its place) in the default run
@pytest.mark.parametrize("algorithm", [pytest.param("leader", marks=pytest.mark.slow),
                                       pytest.param("fedavg", marks=pytest.mark.slow)])
def test_a_synchronous_task_whose_leader_is_killed_completes_under_the_next(tmp_path, algorithm):
    procs = Processes(tmp_path)
    hold = Hold(tmp_path, 301)  # a third of the way: cycle 150 of 450 (30 epochs of 30 steps, 2 a cycle)
    try:
        bootstrap, ids = start_network(procs, 3, provider_args=("--models-module", MODELS), provider_env=hold.env)
        # the leader with DiLoCo's outer step: each provider keeps its outer state, so the leader's death loses none
        sync = ["--leader-sync", "true", "--outer", "nesterov:lr=0.7,momentum=0.9"] if algorithm == "leader" else []
        request = procs.start("req", "request", "--bootstrap", bootstrap, "--output", str(tmp_path / "req"), *TASK,
                              "--model", "held-mlp", "--models-module", MODELS,
                              "--algorithm", algorithm, *sync, "--epochs", "30", "--providers", "3",
                              "--aggregate-every", "2", "--peer-timeout", "6")
        hold.wait_held(procs, ids)
        total = int(procs.wait_for("req", r"p1: training \d+/(\d+)", timeout=120).group(1))
        procs.kill("p0")
        hold.release()
        assert request.wait(timeout=240) == 0, procs.log("req")
        metrics = json.loads((tmp_path / "req" / "metrics.json").read_text())
        assert metrics["leader"] == "p1" and metrics["leaders_lost"] == ["p0"] and metrics["lost"] == ["p0"]
        # p1 took over in the middle, from its latest aggregate: each cycle it led waited for both living providers
        models = metrics["cycle_models"]
        assert 0 < len(models) < total - 1 and set(models.values()) == {2}
        assert metrics["accuracy"] > 0.5
        assert score_result(tmp_path / "req") == pytest.approx(metrics["accuracy"], abs=1e-9)
    finally:
        procs.stop_all()
