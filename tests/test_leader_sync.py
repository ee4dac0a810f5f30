"""The leader's synchronous mode (``leader_sync``): every cycle waits for every living member, and
every member of a cycle gets one aggregate; ``leader_fraction`` makes it FedAvg's. (In the
network: tests/test_network_sync.py.)"""

import csv

import pytest
import torch

from meshlearn.clock import FakeClock
from meshlearn.config import make_config
from meshlearn.definitions.fedavg import participants
from meshlearn.definitions.leaderstate import LeaderState, Push
from meshlearn.definitions.settings import LeaderSettings
from meshlearn.definitions.settings import drawn as count_of
from meshlearn.sim import simulate


def _state(value: float) -> torch.Tensor:
    return torch.full((4,), value)


def _sync_book(clock: FakeClock, members=(0, 1, 2), **kwargs) -> LeaderState:
    return LeaderState(list(members), me=0, peer_timeout=10.0, first_barrier=True, weighting="equal", clock=clock,
                       sync=True, **kwargs)


def test_a_synchronous_cycle_waits_for_every_member_and_answers_all_with_one_aggregate():
    clock = FakeClock()
    book = _sync_book(clock)
    for member, value in ((0, 0.0), (1, 3.0), (2, 6.0)):
        book.submit(member, _state(value), samples=10, final=False, cycle=0)
    assert list(book.release([0, 1, 2])) == [0, 1, 2]
    assert torch.allclose(book.release([1])[1], _state(3.0))
    book.submit(1, _state(100.0), samples=10, final=False, cycle=1)  # a fast member's next cycle ...
    assert 1 not in book.release([1])  # ... waits for the others' cycle 1, however long they take
    clock.advance(5.0)
    for member in (0, 1, 2):
        book.touch(member)  # alive (they ping): still waited for
    clock.advance(9.0)
    assert 1 not in book.release([1])
    assert torch.allclose(book.release([2])[2], _state(3.0))  # a slower member's cycle 0: the same aggregate
    book.submit(0, _state(1.0), samples=10, final=False, cycle=1)
    assert book.release([0, 1]) == {}
    book.submit(2, _state(7.0), samples=10, final=False, cycle=1)
    assert list(book.release([0, 1, 2])) == [0, 1, 2]
    assert torch.allclose(book.release([0])[0], _state(36.0))
    assert book.rounds == {0: 3, 1: 3}


def test_a_lost_member_is_no_longer_waited_for():
    clock = FakeClock()
    book = _sync_book(clock)
    for member in (0, 1, 2):
        book.submit(member, _state(float(member)), samples=10, final=False, cycle=0)
    book.submit(0, _state(2.0), samples=10, final=False, cycle=1)
    book.submit(1, _state(4.0), samples=10, final=False, cycle=1)
    clock.advance(9.0)
    book.touch(1)
    assert 0 not in book.release([0])  # 2 is silent, not yet for the peer timeout
    clock.advance(1.5)
    assert list(book.release([0, 1])) == [0, 1]  # 2 is lost: left out of the aggregate too
    assert torch.allclose(book.release([0])[0], _state(3.0)) and book.rounds[1] == 2


def test_a_fraction_takes_the_drawn_members_models_each_cycle():
    clock = FakeClock()
    members = list(range(6))
    drawn = {cycle: participants(5, cycle, 6, count_of(0.5, 6)) for cycle in range(2)}
    book = _sync_book(clock, members, drawn=lambda cycle, group: drawn[cycle])
    for member in members:
        book.submit(member, _state(float(member)), samples=10, final=False, cycle=0)
    assert len(drawn[0]) == 3 and list(book.release(members)) == members  # everyone is waited for and answered
    assert torch.allclose(book.release([4])[4], _state(sum(drawn[0]) / 3)) and book.rounds == {0: 3}


def test_the_book_of_the_settings_draws_among_the_whole_group_and_releases_each_cycle_once():
    clock = FakeClock()
    settings = LeaderSettings(sync=True, fraction=0.5, weighting="equal")
    group = [1, 3, 5, 7, 9, 11]
    drawn = [group[i] for i in participants(5, 0, 6, count_of(0.5, 6))]
    book = LeaderState.of(settings, group[:5], 1, 5, 10.0, group=group, clock=clock)  # 11 is known dead
    for member in group[:5]:
        book.take(member, Push.after(_state(float(member)), 10, 0, 4))
    answers = book.release([9, 3, 1, 5, 7])
    assert list(answers) == [9, 3, 1, 5, 7] and all(a is answers[1] for a in answers.values())  # one aggregate
    taken = [m for m in drawn if m != 11]
    assert torch.allclose(answers[1], _state(sum(taken) / len(taken))) and book.rounds == {0: len(taken)}
    book.take(1, Push.after(_state(1.0), 10, 1, 4))
    assert book.release([1]) == {} and book.release([3])[3] is answers[3]  # a push sent again: the same answer


def test_a_push_says_its_cycle_whether_it_is_final_and_a_loss_that_is_not_finite_as_inf():
    first, last = Push.after(_state(0.0), 3, 0, 2, 0.5), Push.after(_state(0.0), 3, 1, 2, float("nan"))
    assert (first.cycle, first.final, first.loss) == (0, False, 0.5)
    assert (last.cycle, last.final, last.loss) == (1, True, float("inf"))
    assert Push.after(_state(0.0), 3, 0, 2).loss is None
    book = LeaderState.of(LeaderSettings(first_barrier=True), [0, 1, 2], 0, 1, 10.0, start=False, clock=FakeClock())
    assert book.take(1, first) and book.take(2, last)
    answers = book.release([2, 1])  # taken over: no first-cycle barrier; 2's final push waits for the others
    assert list(answers) == [1] and torch.equal(answers[1], _state(0.0))


@pytest.mark.parametrize("outer", ["none", "nesterov:lr=0.7,momentum=0.9"])  # with DiLoCo's outer step too
def test_every_node_gets_the_same_model_each_cycle_and_both_engines_agree(tmp_path, outer):
    """Every evaluation finds the nodes equal, and the batched engine's leader (the same book, in
    modelled time) gives the process engine's figures, though node 2 is three times slower
    (asynchronous, the evaluations find the nodes apart, and the engines disagree)."""
    runs = {}
    for engine in ("process", "batched"):
        config = make_config({"nodes": 3, "algorithm": "leader", "dataset": "digits", "model": "mlp", "rounds": 5,
                              "batch_size": 16, "lr": 0.05, "iterations": 10, "test_after": 5, "seed": 7,
                              "engine": engine, "leader_sync": True, "slowdown": "2:3", "outer": outer,
                              "output": str(tmp_path / engine)})
        with open(simulate(config, progress=False).output / "summary.csv") as rows:
            runs[engine] = [(float(r["test_acc_mean"]), float(r["test_acc_std"])) for r in csv.DictReader(rows)]
    assert all(std < 1e-12 for run in runs.values() for _, std in run), runs  # equal (the mean of equals rounds)
    flat = {engine: [figure for row in run for figure in row] for engine, run in runs.items()}
    assert len(runs["process"]) == len(runs["batched"]) and flat["process"] == pytest.approx(flat["batched"], abs=1e-6)


def test_a_member_joining_a_synchronous_group_takes_the_newest_full_cycle_and_is_waited_for_after_it():
    clock = FakeClock()
    book = _sync_book(clock)
    for member, value in ((0, 0.0), (1, 3.0), (2, 6.0)):
        book.submit(member, _state(value), samples=10, final=False, cycle=0)
    assert list(book.release([0, 1, 2])) == [0, 1, 2]  # cycle 0: 3.0
    book.submit(1, _state(10.0), samples=10, final=False, cycle=1)  # one member pushed cycle 1 already
    model, cycle = book.join(3, samples=10, own=_state(-1.0))
    assert cycle == 0 and torch.allclose(model, _state(3.0))  # what every member trained cycle 1 from
    for member, value in ((0, 2.0), (2, 6.0)):
        book.submit(member, _state(value), samples=10, final=False, cycle=1)
    assert book.release([0, 1, 2]) == {}  # cycle 1 waits for the newcomer too
    book.submit(3, _state(2.0), samples=10, final=False, cycle=1)
    answers = book.release([0, 1, 2, 3])
    assert list(answers) == [0, 1, 2, 3] and torch.allclose(answers[3], _state(5.0))
    assert book.rounds[1] == 4


def test_a_member_joining_before_any_cycle_starts_from_the_leaders_model_and_is_drawn_after():
    book = LeaderState.of(LeaderSettings(sync=True, fraction=0.5), [0, 1, 2, 3], 0, seed=3, peer_timeout=10.0)
    model, cycle = book.join(4, samples=10, own=_state(7.0))
    assert cycle == -1 and torch.allclose(model, _state(7.0))
    assert book.group == [0, 1, 2, 3, 4]  # fedavg's draws are among five from now on
    drawn = [set(book.drawn(c, book.group)) for c in range(40)]
    assert any(4 in d for d in drawn) and all(len(d) == len(participants(3, 0, 5, count_of(0.5, 5))) for d in drawn)


def test_a_book_taken_over_on_fail_over_lets_a_member_join_once_every_member_pushed_to_it():
    book = LeaderState.of(LeaderSettings(sync=True), [1, 2], 1, seed=3, peer_timeout=10.0, start=False)
    assert book.join(3, samples=10, own=_state(0.0)) is None  # it knows no cycle yet: the newcomer asks again
    book.touch(3)  # the newcomer's pings before it joined: not a member the cycles wait for
    book.take(1, Push.after(_state(1.0), 10, 40, 100))
    assert book.join(3, samples=10, own=_state(0.0)) is None  # 2 has not pushed here yet
    book.take(2, Push.after(_state(2.0), 10, 40, 100))
    assert list(book.release([1, 2])) == [1, 2]
    model, cycle = book.join(3, samples=10, own=_state(0.0))
    assert cycle == 40 and torch.allclose(model, _state(1.5))
