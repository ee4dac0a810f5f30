"""A requester's task lifecycle: the stages a task moves through (``NEXT``), the moves refused, when
each stage was entered under a fake clock, why a task failed; and the requester asking it whether
a failed task holds providers to cancel and release (a real bootstrap and provider on loopback)."""

from __future__ import annotations

import threading

import pytest
from helpers.netproc import running_in_thread

from meshlearn.clock import FakeClock
from meshlearn.errors import NetworkError, TaskFailed
from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings
from meshlearn.network.channel.rpc import RpcServer, call
from meshlearn.network.requester.lifecycle import (
    HOLDING,
    NEXT,
    TaskLifecycle,
    TaskStage,
)
from meshlearn.network.requester.service import Requester
from meshlearn.network.task.spec import TaskRequest

S = TaskStage
SECRET = b"lifecycle-test-secret"
# the stages a task goes through from planning, as far as its settling (it grows once on the way)
ROUTE = [S.CLAIMING, S.CLAIMED, S.ASSIGNING, S.STARTED, S.RUNNING, S.GROWING, S.RUNNING, S.SETTLING]


def _at(stage: TaskStage, clock: FakeClock) -> TaskLifecycle:
    """A lifecycle moved along the usual route up to ``stage``, a second between moves."""
    life = TaskLifecycle("t1", clock)
    for step in ROUTE[:ROUTE.index(stage) + 1] if stage in ROUTE else []:
        clock.advance(1.0)
        life.move(step)
    assert life.stage is stage
    return life


def test_a_task_that_runs_to_its_end_records_every_stage_and_when_it_entered_it():
    clock = FakeClock(start=100.0)
    life = TaskLifecycle("t1", clock)
    assert life.stage is S.PLANNING and life.entered(S.PLANNING) == 100.0 and not life.holds_providers
    for seconds, stage, why in [(2, S.CLAIMING, ""), (3, S.CLAIMED, "2 provider(s)"), (1, S.ASSIGNING, "attempt 1"),
                                (5, S.ASSIGNING, "attempt 2"), (4, S.STARTED, ""), (1, S.RUNNING, ""),
                                (10, S.GROWING, "taking in p2"), (2, S.RUNNING, "p2 joined"),
                                (20, S.SETTLING, "result from p0"), (3, S.DONE, ""), (1, S.RELEASED, "done")]:
        clock.advance(seconds)
        life.move(stage, why)
        assert life.history[-1].why == why
    assert [e.stage for e in life.history] == [S.PLANNING, S.CLAIMING, S.CLAIMED, S.ASSIGNING, S.ASSIGNING,
                                               S.STARTED, S.RUNNING, S.GROWING, S.RUNNING, S.SETTLING, S.DONE,
                                               S.RELEASED]
    assert [e.at for e in life.history] == [100, 102, 105, 106, 111, 115, 116, 126, 128, 148, 151, 152]
    assert life.attempts == 2
    assert life.entered(S.ASSIGNING) == 111.0  # the latest attempt's
    assert life.entered(S.RUNNING) == 128.0 and life.entered(S.CANCELLED) is None
    assert life.seconds_in(S.RUNNING) == 10 + 20  # both stretches, around the newcomer's join
    assert life.seconds_in(S.ASSIGNING) == 5 + 4 and life.seconds_in(S.GROWING) == 2
    clock.advance(7)
    assert life.seconds_in(S.RELEASED) == 7  # the stage it is in counts up to now
    assert life.result_in and life.failure is None and not life.holds_providers


@pytest.mark.parametrize("stage", [S.PLANNING, S.CLAIMING, S.CLAIMED, S.ASSIGNING, S.STARTED, S.RUNNING, S.GROWING,
                                   S.SETTLING])
@pytest.mark.parametrize("cancelled", [False, True], ids=["failed", "cancelled"])
def test_a_task_fails_or_is_cancelled_from_any_stage_before_its_end_and_says_why(stage, cancelled):
    clock = FakeClock(start=0.0)
    life = _at(stage, clock)
    clock.advance(0.5)
    life.fail(f"it broke while {stage.value}", cancelled=cancelled)
    ended = S.CANCELLED if cancelled else S.FAILED
    assert life.stage is ended and life.entered(ended) == clock.monotonic()
    assert life.failure == f"it broke while {stage.value}"
    assert life.history[-2].stage is stage
    assert life.result_in is (stage is S.SETTLING)
    # only a task that held providers has any to cancel and a task to release
    assert life.holds_providers is (stage in HOLDING)
    if stage in HOLDING:
        life.move(S.RELEASED, "failed")
        assert life.stage is S.RELEASED and not life.holds_providers and life.failure == f"it broke while {stage.value}"
    else:
        with pytest.raises(RuntimeError, match="nothing to release"):
            life.move(S.RELEASED)
        assert life.stage is ended
    with pytest.raises(RuntimeError, match="no move from"):
        life.fail("again")


@pytest.mark.parametrize("stage, to", [
    (S.PLANNING, S.RUNNING), (S.PLANNING, S.CLAIMED), (S.CLAIMING, S.ASSIGNING), (S.CLAIMED, S.STARTED),
    (S.ASSIGNING, S.RUNNING), (S.STARTED, S.SETTLING), (S.RUNNING, S.DONE), (S.RUNNING, S.CLAIMED),
    (S.GROWING, S.SETTLING), (S.GROWING, S.GROWING), (S.SETTLING, S.RUNNING), (S.PLANNING, S.PLANNING),
])
def test_a_move_outside_the_table_is_refused_and_changes_nothing(stage, to):
    clock = FakeClock()
    life = _at(stage, clock)
    before = list(life.history)
    with pytest.raises(RuntimeError, match=f"task t1: no move from {stage.value} to {to.value} "):
        life.move(to)
    assert life.history == before and life.stage is stage


@pytest.mark.parametrize("end", [S.DONE, S.FAILED, S.CANCELLED, S.RELEASED])
def test_a_task_that_ended_moves_only_to_its_release_and_a_released_one_nowhere(end):
    clock = FakeClock()
    life = _at(S.SETTLING, clock)
    life.move(end if end is not S.RELEASED else S.DONE)
    if end is S.RELEASED:
        life.move(S.RELEASED)
    for to in S:
        if to in NEXT[end]:
            continue
        with pytest.raises(RuntimeError, match="no move from"):
            life.move(to)
    assert life.stage is end
    if end is S.RELEASED:
        with pytest.raises(RuntimeError, match=r"allowed: none: it is over"):
            life.move(S.PLANNING)


def test_every_stage_but_the_release_can_end_the_task_and_each_is_reachable_from_planning():
    reached, todo = {S.PLANNING}, [S.PLANNING]
    while todo:
        for to in NEXT[todo.pop()]:
            if to not in reached:
                reached.add(to)
                todo.append(to)
    assert reached == set(S)
    assert all({S.FAILED, S.CANCELLED} <= NEXT[s] for s in S if s not in (S.DONE, S.FAILED, S.CANCELLED, S.RELEASED))


# ---- the requester asks its lifecycle (a real bootstrap and provider on loopback) -------------

class RefusingProvider:
    """A provider's server that refuses every task and counts the cancels it is sent."""

    def __init__(self):
        self.cancelled: list[str] = []
        self.assigned = threading.Event()
        self.server = RpcServer("provider", "127.0.0.1", 0, SECRET, {
            "task.assign": self._assign, "task.cancel": self._cancel})

    def _assign(self, req) -> dict:
        self.assigned.set()
        raise NetworkError("busy with another task")

    def _cancel(self, req) -> dict:
        self.cancelled.append(req.body["task"])
        return {"cancelled": True}


@pytest.fixture
def network(tmp_path):
    """A bootstrap in this process with one registered provider that refuses every task."""
    bootstrap = Bootstrap(BootstrapSettings(host="127.0.0.1", port=0, state=str(tmp_path / "b.sqlite"),
                                            dial_back=False), SECRET)
    provider = RefusingProvider()
    provider.server.start()
    try:
        with running_in_thread(bootstrap):
            call(bootstrap.server.address, "register", {"id": "p0", "address": provider.server.address, "ram_gb": 8.0,
                                                        "cores": 2, "device": "cpu", "location": ""}, SECRET, timeout=5)
            yield bootstrap, provider
    finally:
        provider.server.stop()


def _requester(bootstrap: Bootstrap, tmp_path, **request) -> Requester:
    return Requester(TaskRequest(**{"data_on_providers": "digits", "providers": 1, **request}), bootstrap.server.address,
                     SECRET, tmp_path / "req", say=lambda _: None)


def test_a_task_no_provider_takes_fails_while_assigning_and_is_cancelled_released_and_reported(network, tmp_path):
    bootstrap, provider = network
    requester = _requester(bootstrap, tmp_path)
    with pytest.raises(TaskFailed, match="no provider could take it: p0 refused the task"):
        requester.run()
    life = requester.lifecycle
    assert [e.stage for e in life.history] == [S.PLANNING, S.CLAIMING, S.CLAIMED, S.ASSIGNING, S.FAILED, S.RELEASED]
    assert "no provider could take it" in life.failure and provider.assigned.is_set()
    assert provider.cancelled == [requester.task_id]  # told to drop it, once
    record = call(bootstrap.server.address, "task", {"task": requester.task_id}, SECRET, timeout=5).body
    assert record["status"] == "failed"  # released as failed: its provider is free again
    faults = [f["text"] for f in bootstrap.tasks.view(requester.task_id)["faults"]]
    assert faults == [f"task failed: {life.failure}"[:256]]


def test_a_task_that_fails_before_its_claim_holds_nothing_to_cancel_or_release(network, tmp_path):
    bootstrap, provider = network
    requester = _requester(bootstrap, tmp_path, device="cuda", wait=0)  # only a cpu provider is free, no fallback
    with pytest.raises(TaskFailed, match="no free cuda provider"):
        requester.run()
    life = requester.lifecycle
    assert [e.stage for e in life.history] == [S.PLANNING, S.CLAIMING, S.FAILED]
    assert life.failure.startswith("no free cuda provider") and not life.holds_providers
    assert provider.cancelled == [] and not provider.assigned.is_set()
    assert bootstrap.tasks.view(requester.task_id) is None  # nothing reported: the task never was the network's


def test_a_claim_of_fewer_providers_than_the_task_s_minimum_is_given_back_to_the_bootstrap(network, tmp_path):
    bootstrap, provider = network
    requester = _requester(bootstrap, tmp_path, providers=3, min_providers=2, wait=0)  # one provider is free
    with pytest.raises(TaskFailed, match="1 provider\\(s\\) free, fewer than --min-providers 2"):
        requester.run()
    life = requester.lifecycle
    assert [e.stage for e in life.history] == [S.PLANNING, S.CLAIMING, S.CLAIMED, S.FAILED, S.RELEASED]
    assert not provider.assigned.is_set()
    record = call(bootstrap.server.address, "task", {"task": requester.task_id}, SECRET, timeout=5).body
    assert record["status"] == "failed"  # released: its provider is free for the next task
    free = call(bootstrap.server.address, "discover", {"free_only": True}, SECRET, timeout=5).body["providers"]
    assert [p["id"] for p in free] == ["p0"]
