"""Providers joining a running task: a task that asked for more providers than were free starts
with those it got and takes in one that frees up later (its own shard, the group's current model),
which trains to the end with the others."""

from __future__ import annotations

import json
import re

import pytest
from helpers.hold import MODELS, Hold
from helpers.netproc import start_network

TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "8", "--wait", "0"]
# mlp held at a step until the test has done what must happen mid-task (helpers/hold.py)
HELD_TASK = [*TASK[:2], "--model", "held-mlp", "--models-module", MODELS, *TASK[4:]]


def _provider(procs, bootstrap: str, name: str, *args: str) -> None:
    procs.start(name, "provider", "--bootstrap", bootstrap, "--id", name, "--host", "127.0.0.1",
                "--workdir", str(procs.folder / name), *args)


# slow: the default run takes a provider into a running task below (in a lost one's place), and runs the
# joins of LeaderState, gossip and D-PSGD in test_leader_sync, test_gossip_state and test_growing_group
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["leader", "fedavg", "gossip", "dpsgd"])
def test_a_provider_that_frees_up_joins_a_running_task_and_trains_to_its_end(procs, algorithm):
    hold = Hold(procs.folder, 7)  # the task waits at its providers' 7th step (cycle 3) until "late" joined
    bootstrap, ids = start_network(procs, 3, ttl=4.0, provider_args=("--models-module", MODELS),
                                   provider_env=hold.env)
    folder = procs.folder / "task"
    task = procs.start("task", "request", "--bootstrap", bootstrap, "--output", str(folder), *HELD_TASK,
                       "--algorithm", algorithm, "--epochs", "60", "--aggregate-every", "2", "--providers", "4",
                       "--min-providers", "3")
    hold.wait_held(procs, ids)
    _provider(procs, bootstrap, "late", "--models-module", MODELS)
    joined = procs.wait_for("task", r"provider late joined as provider 3 \(([\d.]+) s from its claim\)", timeout=60)
    procs.wait_for("task", r"late: training")  # its engine is up (D-PSGD's at the round it was given)
    hold.release()
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
    # the task's providers hold at their 7th step (cycle 3) while one is killed, and at their 41st (cycle 20 of
    # 90) until the spare has joined: a fast task cannot end before it joins, a slow machine only waits longer
    hold = Hold(procs.folder, 7, 41)
    bootstrap, ids = start_network(procs, 3, ttl=4.0, provider_args=("--models-module", MODELS),
                                   provider_env=hold.env)
    folder = procs.folder / "task"
    task = procs.start("task", "request", "--bootstrap", bootstrap, "--output", str(folder), *HELD_TASK,
                       "--algorithm", algorithm, "--epochs", "6", "--aggregate-every", "2", "--providers", "3",
                       "--min-providers", "2", "--peer-timeout", "10")  # the spare is up: it joins in a second
    hold.wait_held(procs, ids)
    if algorithm != "dpsgd":
        _provider(procs, bootstrap, "spare", "--models-module", MODELS)  # free, but the task has no free slot
        procs.wait_for("spare", "registered with")  # until it loses a provider
    procs.kill(killed)
    hold.release()
    if algorithm == "dpsgd":  # a newcomer hears the members' models of the round before its own within one
        # wait: it comes once they have waited out the lost one (three rounds' deadlines) and hold at step 41
        hold.wait_held(procs, [pid for pid in ids if pid != killed])
        _provider(procs, bootstrap, "spare", "--models-module", MODELS)
    procs.wait_for("task", rf"provider spare joined as provider 3 in place of {killed} \(its shard\)", timeout=120)
    procs.wait_for("task", r"spare: training")  # its engine is up (D-PSGD's at the round it was given)
    hold.release_all()
    assert task.wait(timeout=240) == 0, procs.log("task")
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["replaced"] == {killed: "spare"} and metrics["lost"] == [killed], metrics
    providers = metrics["providers"]
    assert providers["spare"]["status"] == "finished" and providers[killed]["status"] == "lost"
    assert abs(providers["spare"]["samples"] - providers["p1"]["samples"]) <= 1  # a third of the data: its shard
    assert metrics["accuracy"] > 0.8 and metrics["leader"] == ("p1" if killed == "p0" else "p0")
    # the spare holds the place of the provider it replaced: a resume claims it, for that place
    record = json.loads((folder / "task.json").read_text())
    assert record["providers"] == ["spare" if pid == killed else pid for pid in ids]
