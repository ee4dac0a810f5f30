"""Failure detection that heals (issue 54, point 3): a member given up after one late ping is only
suspected, asked again, and followed again once it answers; one shut out (``exclude``) stays out.
The election alone (on a fake clock), the leader's synchronous book, the process engine's leader in
a run, and a network task's finisher over RPC."""

from __future__ import annotations

import threading
import types

import pytest
import torch
from helpers.waiting import wait_until

from meshlearn.clock import FakeClock
from meshlearn.definitions.leaderstate import LeaderState
from meshlearn.node.algorithms.election import Election

PERIOD = 1.0  # seconds between two checks of the watch (its fake clock's)
PING_TIMEOUT = 0.5  # seconds a ping waits for its answer


class _Group:
    """The other members as pings find them: alive or not, and how late each one's next answers
    come (an injected delay: an answer later than ``PING_TIMEOUT`` is a failed ping)."""

    def __init__(self, members, dead=()):
        self.alive = {rank: rank not in dead for rank in members}
        self.delays: dict[int, list[float]] = {rank: [] for rank in members}
        self.pinged: list[int] = []

    def ping(self, rank: int) -> bool:
        self.pinged.append(rank)
        delay = self.delays[rank].pop(0) if self.delays[rank] else 0.0
        return self.alive[rank] and delay <= PING_TIMEOUT


class _CountingClock(FakeClock):
    """A fake clock that counts the waits begun on it: the watch begins one per period, so a period
    is over once the next wait begins (counted under the clock's lock, before its deadline is read,
    so a test's ``advance`` after the count always ends that wait)."""

    def __init__(self):
        super().__init__()
        self.waits = 0

    def wait(self, event: threading.Event, timeout: float) -> bool:
        with self._cond:
            self.waits += 1
            return super().wait(event, timeout)


class _Watched:
    """An election's ``watch`` in its own thread on a counting fake clock, moved one period at a time."""

    def __init__(self, election: Election):
        self.election, self.clock, self.stop = election, _CountingClock(), threading.Event()
        self.thread = threading.Thread(target=election.watch, args=(self.stop, PERIOD, self.clock), daemon=True)

    def __enter__(self):
        self.thread.start()
        assert wait_until(lambda: self.clock.waits == 1)
        return self

    def period(self) -> None:
        """Let one period pass, and return once its check is done."""
        begun = self.clock.waits
        self.clock.advance(PERIOD)
        assert wait_until(lambda: self.clock.waits > begun), "the watch did not come back to wait"

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.election.poke()
        self.thread.join(10)
        assert not self.thread.is_alive()


# --- the election ---------------------------------------------------------------------------------


def test_a_member_whose_ping_to_the_live_leader_came_late_follows_it_again_within_two_periods():
    """The acceptance test: one ping to the leader fails by an injected delay; the member suspects
    it and follows the next member, and is back with the true leader at the end of the next period."""
    group = _Group(range(4))
    lost, back = [], []
    election = Election(range(4), me=2, ping=group.ping, on_dead=lost.append, on_alive=back.append)
    with _Watched(election) as watched:
        watched.period()
        assert election.leader == 0 and group.pinged == [0] and not election.dead  # a live leader, on time
        group.delays[0] = [2 * PING_TIMEOUT]  # its next answer comes late: a busy machine
        watched.period()
        assert election.leader == 1 and election.suspected == {0} and lost == [0]
        watched.period()
        assert election.leader == 0 and not election.dead and back == [0]  # taken back within two periods
        assert group.pinged == [0, 0, 1, 1, 0]  # period 2: the leader, then its successor; period 3: both once
        watched.period()
        assert election.leader == 0 and group.pinged[5:] == [0]  # no one suspected: the leader alone


def test_a_member_that_led_after_a_late_ping_gives_the_lead_back_within_two_periods():
    group = _Group(range(3))
    election = Election(range(3), me=1, ping=group.ping)
    group.delays[0] = [2 * PING_TIMEOUT]
    election.check()
    assert election.leader == 1 and election.suspected == {0}  # no one below answers: it leads itself
    election.check()  # it leads: it pings no leader, only the member it suspects
    assert election.leader == 0 and not election.dead and group.pinged == [0, 0]


def test_a_member_really_gone_stays_suspected_and_does_not_keep_others_from_coming_back():
    group = _Group(range(4), dead={0})
    election = Election(range(4), me=3, ping=group.ping)
    group.delays[1] = [2 * PING_TIMEOUT]
    assert election.resolve() == 2 and election.suspected == {0, 1}
    del group.pinged[:]
    election.check()  # the leader, and one suspected member a period: 0 first ...
    assert group.pinged == [2, 0] and election.leader == 2
    election.check()  # ... then the next one, which answers
    assert group.pinged == [2, 0, 2, 1] and election.leader == 1 and election.suspected == {0}
    election.check()
    election.check()
    assert group.pinged[4:] == [1, 0, 1, 0] and election.leader == 1  # the gone one, asked once a period


def test_an_excluded_member_is_never_followed_again_even_if_it_answers():
    group = _Group(range(3))
    lost = []
    election = Election(range(3), me=2, ping=group.ping, on_dead=lost.append)
    assert election.exclude(0) and not election.exclude(0) and not election.exclude(2)  # never itself
    assert election.leader == 0  # until the watch checks: it does not ping an excluded leader, it moves on
    election.check()
    assert election.leader == 1 and group.pinged == [1]
    for _ in range(3):
        election.check()
    assert 0 not in group.pinged and election.leader == 1  # never asked again
    assert not election.revive(0) and not election.recheck(0) and not election.mark_dead(0)
    assert election.excluded == {0} and not election.suspected and lost == [0]
    election.mark_dead(1)  # a suspected member shut out afterwards is out for good
    assert election.exclude(1) is False and election.excluded == {0, 1} and not election.recheck(1)


def test_a_not_leader_answer_naming_a_suspected_leader_brings_it_back():
    """Member 2 gave 0 up after a late ping and follows 1; 1 answers its push "not-leader, 0 leads":
    2 pings 0 at once and follows it again."""
    group = _Group(range(3))
    election = Election(range(3), me=2, ping=group.ping)
    group.delays[0] = [2 * PING_TIMEOUT]
    assert election.resolve() == 1 and election.suspected == {0}
    assert election.recheck(0) and election.leader == 0 and not election.dead
    assert not election.recheck(0) and not election.recheck(1)  # nothing suspected: nothing pinged
    assert group.pinged == [0, 1, 0]
    group.alive[0] = False  # named, but really gone: it stays suspected
    election.mark_dead(0)
    assert not election.recheck(0) and election.suspected == {0}


def test_a_member_taken_back_while_the_leader_is_looked_for_leads():
    """``resolve`` pings a member (slowly) while another thread takes a lower one back: the lower one
    leads, resolve does not put the one it found over it."""
    in_ping, answer = threading.Event(), threading.Event()

    def ping(rank):
        if rank == 2:
            in_ping.set()
            assert answer.wait(10)
        return rank != 0
    election = Election(range(4), me=3, ping=ping)
    assert election.resolve() == 1 and election.suspected == {0}
    election.mark_dead(1)
    resolving = threading.Thread(target=election.resolve)
    resolving.start()
    try:
        assert in_ping.wait(10)
        assert election.revive(0) and election.leader == 0
    finally:
        answer.set()
        resolving.join(10)
    assert election.leader == 0 and election.suspected == {1}


# --- the synchronous book ---------------------------------------------------------------------------


def test_a_member_a_busy_leader_counted_lost_is_waited_for_again_from_the_next_cycle():
    """The leader counts a member lost that was only slow: that cycle goes on without it, its late push
    gets the cycle's aggregate (one model for the group still), and the next cycle waits for it again
    and takes its model."""
    clock = FakeClock()
    book = LeaderState([0, 1, 2], me=0, peer_timeout=10.0, first_barrier=False, weighting="equal", clock=clock,
                       sync=True)
    for member in (0, 1, 2):
        book.submit(member, torch.full((2,), float(member)), samples=1, final=False, cycle=0)
    assert list(book.release([0, 1, 2])) == [0, 1, 2]
    book.submit(0, torch.full((2,), 3.0), samples=1, final=False, cycle=1)
    book.submit(1, torch.full((2,), 5.0), samples=1, final=False, cycle=1)
    clock.advance(6.0)
    book.touch(1)
    clock.advance(5.0)  # 2 silent for longer than the peer timeout
    first = book.release([0, 1])
    assert list(first) == [0, 1] and book.is_lost(2) and book.rounds[1] == 2
    assert book.submit(2, torch.full((2,), 7.0), samples=1, final=False, cycle=1)  # late, but alive
    assert not book.is_lost(2) and torch.equal(book.release([2])[2], first[0])  # the cycle's one aggregate
    book.submit(0, torch.full((2,), 0.0), samples=1, final=False, cycle=2)
    book.submit(1, torch.full((2,), 3.0), samples=1, final=False, cycle=2)
    assert book.release([0, 1]) == {}  # cycle 2 waits for 2 again
    book.submit(2, torch.full((2,), 6.0), samples=1, final=False, cycle=2)
    assert torch.allclose(book.release([0])[0], torch.full((2,), 3.0)) and book.rounds[2] == 3


# --- the process engine's leader ------------------------------------------------------------------


@pytest.mark.parametrize("late", [1, 2])  # 1: it leads meanwhile (no one below answers); 2: it follows 1
def test_a_member_whose_ping_to_the_leader_fails_once_follows_it_again_in_a_synchronous_run(late):
    """Three members in threads, synchronous: member ``late`` takes the leader for gone once (one
    ping's answer counted late) at its second cycle. It comes back to the leader, no cycle leaves a
    member out, and every member ends following member 0 with one model."""
    from meshlearn.config import make_config
    from meshlearn.node import build_node
    from meshlearn.sim.inprocess import run_threads
    from meshlearn.topology import build_topology

    config = make_config({"nodes": 3, "algorithm": "leader", "dataset": "digits", "model": "mlp", "rounds": 2,
                          "iterations": 6, "batch_size": 16, "lr": 0.05, "seed": 3, "leader_sync": True,
                          "wait_timeout": 4, "test_after": 6})
    graph = build_topology(config.topology, config.nodes, config.seed)
    nodes = [build_node(config, rank, graph) for rank in range(config.nodes)]
    member = nodes[late].algorithm
    armed, failed = threading.Event(), threading.Event()
    real_ping, real_lost, real_back = member._ping, member._lost, member._taken_back
    lost, back = [], []
    member._lost = lambda rank: (lost.append(rank), real_lost(rank))
    member._taken_back = lambda rank: (back.append(rank), real_back(rank))

    def ping(rank: int) -> bool:  # (set before the run: the election takes it at start)
        answered = real_ping(rank)
        if rank == 0 and armed.is_set() and not failed.is_set():
            failed.set()
            return False  # its answer came after the ping's timeout
        return answered
    member._ping = ping

    def fail_one_ping(node, iteration: int, record: dict) -> None:
        if iteration == 1:
            armed.set()
            node.algorithm.election.poke()  # the watch pings the leader now
            assert failed.wait(30)

    nodes[late].hooks.append(fail_one_ping)
    run_threads(nodes, timeout=120)
    assert failed.is_set() and 0 in lost and sorted(back) == sorted(lost)  # suspected, then taken back
    assert all(node.algorithm.election.leader == 0 and not node.algorithm.election.dead for node in nodes)
    assert nodes[late].algorithm.state is None  # whatever it led meanwhile, it holds no book now
    assert nodes[0].algorithm.state.rounds == dict.fromkeys(range(config.iterations - 1), 3)  # no member left out
    assert all(torch.equal(node.flat.state, nodes[0].flat.state) for node in nodes)


# --- a network task's finisher --------------------------------------------------------------------


def test_a_provider_that_does_not_lead_names_its_leader_and_a_follower_that_gave_it_up_takes_it_back(tmp_path):
    """Over RPC: p2 gave p0 up after a late ping and pushes its final model to p1, which answers that
    it does not lead, naming p0 (and its pings name it too); p2 pings p0, follows it again, and its
    final model goes there."""
    from torch import nn

    from meshlearn.flat import FlatState
    from meshlearn.network.channel.rpc import RpcServer
    from meshlearn.network.protocol import rpcs
    from meshlearn.network.protocol.serving import serve
    from meshlearn.network.provider.finish import Finisher
    from meshlearn.network.provider.taskrun import ProviderContext
    from meshlearn.network.task.spec import TaskSpec

    secret = b"election-test-secret"
    servers = [RpcServer(f"p{i}", "127.0.0.1", 0, secret, {}) for i in range(3)]
    for server in servers:
        server.bind()
    spec = TaskSpec(task_id="t54", model="mlp", epochs=1, batch_size=16, lr=0.1, algorithm="leader",
                    aggregate_every="epoch", seed=1, partition="iid", eval_samples=0, peer_timeout=4,
                    peers=[{"id": f"p{i}", "address": s.address} for i, s in enumerate(servers)],
                    data={"mode": "local", "dataset": "digits"})
    finishers = [Finisher(spec, ProviderContext(f"p{i}", "127.0.0.1", secret, tmp_path / f"w{i}"), i)
                 for i in range(3)]
    for finisher, server in zip(finishers, servers):
        finisher.attach(types.SimpleNamespace(flat=FlatState(nn.Linear(4, 2))), samples=10)
        handlers = {rpcs.AGG_PUSH: finisher.on_push, rpcs.AGG_PING: finisher.on_ping}
        server.handlers.update(serve(rpcs.Server.PROVIDER, handlers, declared=tuple(handlers)))
        server.start()
    try:
        follower = finishers[2]
        follower.election.mark_dead(0)  # as after a ping answered late
        assert follower.election.resolve() == 1 and follower._ping(1).leader == 0
        assert not follower._push_final(1, updates=3)  # refused: p1 does not lead, p0 does
        assert follower.election.leader == 0 and not follower.election.dead
        assert follower._push_final(0, updates=3) and finishers[0].book.has_final(2)
        follower.exclude(0)  # shut out: what it answers no longer brings it back
        assert not follower._alive(0) and not follower.election.recheck(0)
    finally:
        for server in servers:
            server.stop()
