"""Providers joining a running task: a task that asked for more providers than were free starts
with those it got and takes in one that frees up later (its own shard, the group's current model),
which trains to the end with the others."""

from __future__ import annotations

import json
import re

import pytest
from helpers.netproc import start_network

TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "8", "--wait", "0"]


def _provider(procs, bootstrap: str, name: str) -> None:
    procs.start(name, "provider", "--bootstrap", bootstrap, "--id", name, "--host", "127.0.0.1",
                "--workdir", str(procs.folder / name))


# slow: the default run takes a provider into a running task below (in a lost one's place), and runs the
# joins of LeaderState, gossip and D-PSGD in test_leader_sync, test_gossip_state and test_growing_group
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["leader", "fedavg", "gossip", "dpsgd"])
def test_a_provider_that_frees_up_joins_a_running_task_and_trains_to_its_end(procs, algorithm):
    bootstrap, _ = start_network(procs, 0, ttl=4.0)
    ids = ["p0", "p1", "p2"]
    for pid in ids:
        _provider(procs, bootstrap, pid)
    for pid in ids:
        procs.wait_for(pid, "registered with")
    folder = procs.folder / "task"
    task = procs.start("task", "request", "--bootstrap", bootstrap, "--output", str(folder), *TASK,
                       "--algorithm", algorithm, "--epochs", "60", "--aggregate-every", "2", "--providers", "4",
                       "--min-providers", "3")
    procs.wait_for("task", r"started on 3 provider", timeout=120)  # many short cycles: long enough on
    # loopback (under a loaded machine's too) for another provider to start and join the task as it runs
    _provider(procs, bootstrap, "late")
    joined = procs.wait_for("task", r"provider late joined as provider 3 \(([\d.]+) s from its claim\)", timeout=60)
    assert float(joined.group(1)) < 10
    assert task.wait(timeout=240) == 0, procs.log("task")
    out = procs.log("task")
    assert "taking in more as they come free" in out
    metrics = json.loads((folder / "metrics.json").read_text())
    assert sorted(metrics["providers"]) == sorted([*ids, "late"]) and metrics["lost"] == []
    assert metrics["providers"]["late"]["status"] == "finished" and metrics["accuracy"] > 0.8
    assert json.loads((folder / "task.json").read_text())["providers"] == [*ids, "late"]
    first = re.search(r"late: training (\d+)/(\d+)", out)  # it trained from the group's cycle to the end
    assert 0 < int(first.group(1)) < int(first.group(2))


def test_joining_is_refused_in_one_line_where_the_algorithm_cannot_take_newcomers(procs):
    proc = procs.start("refused", "request", "--bootstrap", "127.0.0.1:1", *TASK, "--algorithm", "dpsgd",
                       "--transport", "udp", "--providers", "4", "--min-providers", "2")
    assert proc.wait(timeout=60) == 2
    lines = procs.log("refused").strip().splitlines()
    assert "--min-providers with dpsgd takes --transport tcp and --aggregation mean" in lines[-1], lines


# the default case kills the leader of a synchronous task (test_network_sync's, slow, kills only that)
SLOW_PLACES = (("leader", "p0"), ("gossip", "p2"), ("dpsgd", "p2"))


@pytest.mark.parametrize("algorithm, killed", [("fedavg", "p0"),
                                               *(pytest.param(a, k, marks=pytest.mark.slow) for a, k in SLOW_PLACES)])
def test_a_provider_that_frees_up_takes_the_place_and_shard_of_one_the_task_lost(procs, algorithm, killed):
    bootstrap, ids = start_network(procs, 3, ttl=4.0)
    folder = procs.folder / "task"
    task = procs.start("task", "request", "--bootstrap", bootstrap, "--output", str(folder), *TASK,
                       "--algorithm", algorithm, "--epochs", "20", "--aggregate-every", "2", "--providers", "3",
                       "--min-providers", "2", "--peer-timeout", "10")  # the spare is up: it joins in a second
    procs.wait_for("task", r"p\d: training \d+/\d+", timeout=120)
    _provider(procs, bootstrap, "spare")  # free, but the task has no free slot until it loses a provider
    procs.wait_for("spare", "registered with")
    procs.kill(killed)
    procs.wait_for("task", rf"provider spare joined as provider 3 in place of {killed} \(its shard\)", timeout=60)
    assert task.wait(timeout=240) == 0, procs.log("task")
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["replaced"] == {killed: "spare"} and metrics["lost"] == [killed], metrics
    providers = metrics["providers"]
    assert providers["spare"]["status"] == "finished" and providers[killed]["status"] == "lost"
    assert abs(providers["spare"]["samples"] - providers["p1"]["samples"]) <= 1  # a third of the data: its shard
    assert metrics["accuracy"] > 0.8 and metrics["leader"] == ("p1" if killed == "p0" else "p0")
    assert json.loads((folder / "task.json").read_text())["providers"] == [*ids, "spare"]
