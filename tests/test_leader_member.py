"""A leader aggregation member's decisions (``LeaderMember``), on a fake clock: its cycle, its push
and loss, the seconds it waited, when it sends a refused push again, what its model weighs where it
says so itself; and driven with the leader's book (``LeaderState``) as both engines drive them."""

import math

import pytest
import torch

from meshlearn.clock import FakeClock
from meshlearn.definitions.fedavg import participants
from meshlearn.definitions.leadermember import (
    LOSS_SAID_LIMIT,
    MAX_REFUSED_BACKOFF,
    REFUSED_BACKOFF,
    LeaderMember,
)
from meshlearn.definitions.leaderstate import LeaderState
from meshlearn.definitions.settings import LeaderSettings

PEER_TIMEOUT = 10.0


def _state(value: float) -> torch.Tensor:
    return torch.full((4,), value)


def test_a_cycle_pushes_the_mean_loss_of_its_steps_and_counts_the_seconds_until_the_answer():
    clock = FakeClock()
    member = LeaderMember(samples=30, iterations=2, clock=clock)
    member.trained(1.0, 2.0)
    member.trained(6.0)
    member.pushing()
    push = member.push(_state(1.0))
    assert (push.samples, push.cycle, push.final, push.loss) == (30, 0, False, 3.0)
    clock.advance(2.5)
    assert member.answered() == pytest.approx(2.5) and member.cycle == 1 and not member.finished
    member.pushing()  # no steps said a loss since the last push
    last = member.push(_state(2.0))
    assert (last.cycle, last.final, last.loss) == (1, True, None)
    assert member.answered() == 0.0 and member.finished


def test_an_engine_that_counts_its_own_cycles_sets_the_one_a_push_is_of():
    member = LeaderMember(samples=5, iterations=10, clock=FakeClock(), cycle=3)  # a newcomer's first cycle
    assert member.push(_state(0.0)).cycle == 3
    member.trained(None)  # an iteration whose steps did not run
    member.pushing(7)  # a resumed run: the engine's iteration
    push = member.push(_state(0.0))
    assert (push.cycle, push.loss) == (7, None)
    member.answered()
    assert member.cycle == 8


def test_a_loss_that_is_not_finite_is_pushed_as_inf_and_said_as_a_number():
    member = LeaderMember(samples=4, iterations=3, clock=FakeClock())
    member.trained(0.5, float("nan"))
    member.pushing()
    push = member.push(_state(0.0))
    assert push.loss == math.inf
    assert LeaderMember.fields(push) == {"samples": 4, "final": False, "cycle": 0, "loss": LOSS_SAID_LIMIT}
    member.answered()
    member.pushing()
    assert LeaderMember.fields(member.push(_state(0.0)))["loss"] is None


def test_a_refused_push_waits_longer_each_time_in_a_row_up_to_a_limit_and_a_new_push_starts_over():
    member = LeaderMember(samples=1, iterations=5, clock=FakeClock())
    member.pushing()
    waits = [member.refused() for _ in range(8)]
    assert waits[:3] == [REFUSED_BACKOFF, 2 * REFUSED_BACKOFF, 4 * REFUSED_BACKOFF]
    assert waits == sorted(waits) and waits[-1] == MAX_REFUSED_BACKOFF
    member.answered()
    member.pushing()
    assert member.refused() == REFUSED_BACKOFF


@pytest.mark.parametrize("weighting, weight", [("equal", 1.0), ("samples", 12.0), ("staleness", 12.0)])
def test_a_member_weighs_by_the_weighting_where_every_member_is_drawn(weighting, weight):
    member = LeaderMember(12, 4, settings=LeaderSettings(weighting=weighting), seed=3, rank=2)
    assert [member.weight(cycle, [0, 1, 2, 3]) for cycle in range(4)] == [weight] * 4


def test_a_member_weighs_nothing_in_the_cycles_the_books_draw_leaves_it_out_of():
    settings, seed, group = LeaderSettings(sync=True, fraction=0.5, weighting="equal"), 5, [1, 3, 5, 7, 9, 11]
    book = LeaderState.of(settings, group, 1, seed, PEER_TIMEOUT, clock=FakeClock())
    members = {rank: LeaderMember(10, 8, settings=settings, seed=seed, rank=rank) for rank in group}
    for cycle in range(8):
        drawn = {group[i] for i in participants(seed, cycle, len(group), settings.drawn(len(group)))}
        assert set(book.drawn(cycle, group)) == drawn and len(drawn) == 3
        assert {rank for rank, member in members.items() if member.weight(cycle, group)} == drawn


def test_the_first_cycle_waits_until_the_books_deadline_and_the_member_counts_that_wait():
    clock = FakeClock()
    book = LeaderState.of(LeaderSettings(weighting="samples"), [0, 1, 2], 0, 0, PEER_TIMEOUT, clock=clock)
    assert book.first_deadline() == clock.monotonic() + PEER_TIMEOUT  # an engine with events schedules it
    members = [LeaderMember(10, 3, clock=clock) for _ in range(3)]
    for rank in (0, 1):
        members[rank].pushing()
        book.take(rank, members[rank].push(_state(float(rank))))
    clock.advance(4.0)
    assert book.release([0, 1]) == {}  # member 2 has not pushed: the first cycle waits for it
    clock.advance(PEER_TIMEOUT - 4.0)
    book.touch(0)
    book.touch(1)  # members 0 and 1 keep pinging; 2 is silent
    answers = book.release([0, 1])
    assert list(answers) == [0, 1] and torch.equal(answers[0], _state(0.5))
    assert [members[rank].answered() for rank in (0, 1)] == [PEER_TIMEOUT, PEER_TIMEOUT]
    assert book.first_deadline() is None  # the barrier is over: later pushes are answered at once
    members[0].pushing()
    book.take(0, members[0].push(_state(2.0)))
    assert list(book.release([0])) == [0] and members[0].answered() == 0.0


def test_a_book_without_the_first_barrier_has_no_deadline():
    clock = FakeClock()
    assert LeaderState.of(LeaderSettings(first_barrier=False), [0, 1], 0, 0, PEER_TIMEOUT, clock=clock) \
        .first_deadline() is None
    assert LeaderState.of(LeaderSettings(), [0, 1], 0, 0, PEER_TIMEOUT, start=False, clock=clock) \
        .first_deadline() is None  # a book taken over on fail-over


def test_synchronous_members_each_wait_for_the_slowest_push_of_their_cycle():
    clock = FakeClock()
    book = LeaderState.of(LeaderSettings(sync=True), [0, 1, 2], 0, 0, PEER_TIMEOUT, clock=clock)
    members = [LeaderMember(10, 2, clock=clock) for _ in range(3)]
    held: list[int] = []
    waited: dict[int, float] = {}
    for rank in range(3):  # each pushes a second after the one before
        clock.advance(1.0 if rank else 0.0)
        members[rank].trained(float(rank))
        members[rank].pushing()
        book.take(rank, members[rank].push(_state(float(rank))))
        held.append(rank)
        for answered, aggregate in book.release(held).items():
            held.remove(answered)
            assert torch.equal(aggregate, _state(1.0))
            waited[answered] = members[answered].answered()
    assert waited == {0: 2.0, 1: 1.0, 2: 0.0} and [m.cycle for m in members] == [1, 1, 1]
    assert [m.loss for m in members] == [0.0, 1.0, 2.0]
