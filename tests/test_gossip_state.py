"""Gossip's per-node state machine (``GossipState``) under a fake clock, numbers checked by hand;
and the process engine's ``GossipAverager`` driving it with a stand-in endpoint."""

from concurrent.futures import Future

import pytest
import torch
from torch import nn

from meshlearn.aggregation import get_rule
from meshlearn.clock import FakeClock
from meshlearn.definitions.gossipstate import (
    DIVERGED,
    MERGED,
    NO_ANSWER,
    REFUSED,
    Fetch,
    GossipState,
    Reply,
)
from meshlearn.definitions.settings import GossipSettings
from meshlearn.flat import FlatState
from meshlearn.node.algorithms.gossip import GossipAverager
from meshlearn.wire import Kind, Message

START = 100.0


def _node(peers=(1,), time=None, **settings):
    values = {"fetch_probability": 1.0, "timeout": 2.0, "interpolation": "constant", "value": 0.25, **settings}
    return GossipState(list(peers), GossipSettings(**values), seed=7, time=time or FakeClock(START))


def test_a_fetch_is_planned_on_the_injected_clock_with_a_fresh_wait_of_the_step_time():
    clock = FakeClock(START)
    node = _node(time=clock)
    assert node.start_step(0.4) == Fetch(peer=1, wait=0.4, started=START, deadline=START + 2.0)
    assert node.start_step(0.4) is None  # one fetch at a time: the pending one is not judged yet
    node.judge(None, 1.0)
    clock.advance(5.0)
    assert node.start_step(3.0) == Fetch(1, 1.0, START + 5.0, START + 7.0)  # a fresh wait is at most half the timeout
    stale = _node(fresh=False)
    assert stale.start_step(0.4).wait == 0.0  # dpwa's fetch: what the peer already has


def test_fetch_probability_zero_never_fetches():
    node = _node(peers=(1, 2, 3), fetch_probability=0.0)
    assert all(node.start_step(0.1) is None for _ in range(200))
    assert node.fetch is None and node.tally() == (0, 0)


def test_an_accepted_reply_moves_by_the_interpolation_factor_and_updates_the_clock():
    node = _node()
    node.trained(3.0)
    node.start_step(0.1)
    own, peer_state = torch.zeros(4), torch.full((4,), 8.0)
    verdict = node.judge(Reply(clock=7.0, loss=1.0, tensors=(peer_state,)), own_loss=2.0)
    assert verdict.outcome == MERGED and verdict.merged and verdict.peer == 1 and verdict.factor == 0.25
    own.lerp_(peer_state, verdict.factor)  # what an engine does with a plain (non-robust) verdict
    assert torch.equal(own, torch.full((4,), 2.0))  # 0 + 0.25 * (8 - 0)
    assert node.clock == 0.25 * 7.0 + 0.75 * 3.0  # dpwa's clock moves as the model does: 4.0
    assert node.scores.score[1] == node.scores.HIGH and node.watch.peers[1].heard == 1
    assert node.fetch is None and node.tally() == (1, 0) and node.tally() == (0, 0)


def test_the_clock_and_loss_rules_read_the_node_and_the_reply():
    by_clock = _node(interpolation="clock")
    by_clock.trained(1.0)
    by_clock.start_step(0.1)
    assert by_clock.judge(Reply(3.0, 1.0, ()), 1.0).factor == 3.0 / 4.0  # peer_clock / (clock + peer_clock)
    assert by_clock.clock == 0.75 * 3.0 + 0.25 * 1.0
    by_loss = _node(interpolation="loss")
    by_loss.start_step(0.1)
    assert by_loss.judge(Reply(1.0, 1.0, ()), 3.0).factor == 3.0 / 4.0  # my loss / (mine + the peer's)
    lost = _node()
    lost.start_step(0.1)
    assert lost.judge(Reply(5.0, 1.0, ()), float("nan")).factor == 1.0  # my own loss diverged: take all of the peer
    assert lost.clock == 5.0


def test_no_answer_penalises_the_peer_counts_a_failure_and_sits_it_out_after_three():
    node = _node(peers=(1,))
    for missed in range(1, 4):
        node.start_step(0.1)
        verdict = node.judge(None, 1.0)
        assert verdict.outcome == NO_ANSWER and not verdict.merged and verdict.factor == 0.0
        assert node.scores.score[1] == 1000.0 - 100.0 * missed and node.scores.failures[1] == missed
    assert node.clock == 0.0 and node.tally() == (0, 3)
    assert node.watch.peers == {}  # silence is not a bad model
    assert [node.start_step(0.1) for _ in range(2)] == [None, None]  # sits out 2 ** (3 - 2) picks
    assert node.start_step(0.1).peer == 1


@pytest.mark.parametrize("loss", [None, float("inf"), float("nan")])
def test_a_diverged_peer_is_not_merged_nor_counted_as_refused(loss):
    node = _node()
    node.start_step(0.1)
    verdict = node.judge(Reply(5.0, loss, (torch.full((4,), float("nan")),)), 1.0)
    assert verdict.outcome == DIVERGED and not verdict.merged
    assert node.clock == 0.0 and node.scores.score[1] == 900.0 and node.tally() == (0, 1)
    assert node.watch.peers == {}  # an honest failure, not a bad model


def test_nan_another_model_or_a_clock_that_is_no_number_is_refused_and_watched():
    node = _node()
    replies = [Reply(5.0, 1.0, (torch.ones(2), torch.tensor([1.0, float("inf")]))),
               Reply(5.0, 1.0, (torch.ones(2),), problem="tensor 'w' is torch.float64"),
               Reply(None, 1.0, (torch.ones(2),))]
    for reply in replies:
        node.start_step(0.1)
        assert node.judge(reply, 1.0).outcome == REFUSED
    record = node.watch.peers[1]
    assert record.refused == 3 and record.last_reason == "its clock is not a number"
    assert node.clock == 0.0 and node.tally() == (0, 3) and node.watch.suspects() == [1]


def test_judging_without_a_fetch_is_an_error():
    with pytest.raises(RuntimeError, match="no fetch pending"):
        _node().judge(None, 1.0)


def test_a_robust_node_stays_put_until_it_has_pulled_two_peers_then_moves_toward_the_rule():
    node = GossipState([1, 2, 3], GossipSettings(interpolation="constant", value=0.5), rule=get_rule("median"),
                       time=FakeClock())
    own = torch.zeros(3)
    node.move_robustly(own, torch.full((3,), 10.0), 1, 0.5)
    assert torch.equal(own, torch.zeros(3))  # one peer's model alone could outvote the node
    node.move_robustly(own, torch.full((3,), 1.0), 2, 0.5)
    assert torch.equal(own, torch.full((3,), 0.5))  # halfway to median(0, 10, 1) = 1
    assert sorted(node.latest) == [1, 2]


def test_what_a_node_publishes_reads_back_as_the_reply_its_peers_judge():
    node = _node()
    node.trained(2.0)
    assert node.meta(None) == {"clock": 2.0, "loss": 0.0}  # before any loss: 0, as a fresh node publishes
    assert node.meta(float("nan")) == {"clock": 2.0, "loss": None}  # a diverged node: peers take nothing
    reply = Reply.read(node.meta(1.5), (torch.ones(2),))
    assert (reply.clock, reply.loss, reply.problem) == (2.0, 1.5, None)
    assert Reply.read({"clock": -1.0, "loss": "x"}, ()).clock is None  # a peer's metadata is checked


def test_take_judges_then_moves_the_state_segment_by_segment_and_only_when_merged():
    node = _node()
    own = torch.zeros(5)
    node.start_step(0.1)
    verdict, _ = node.take(Reply(1.0, 1.0, (torch.full((2,), 4.0), torch.full((3,), 8.0))), 1.0, own)
    assert verdict.merged and verdict.factor == 0.25
    assert torch.equal(own, torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0]))  # each segment lerped toward its own
    node.start_step(0.1)
    verdict, _ = node.take(Reply(1.0, None, (torch.full((5,), 8.0),)), 1.0, own)
    assert verdict.outcome == DIVERGED and torch.equal(own, torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0]))


def test_a_fetch_the_engine_cannot_send_is_forgotten():
    node, sent = _node(), []
    assert node.start_step(0.1, sent.append) == sent[0] == node.fetch

    def broken(fetch):
        raise ConnectionError("down")

    node.cancel()
    with pytest.raises(ConnectionError):
        node.start_step(0.1, broken)
    assert node.fetch is None


def test_the_iteration_columns_are_the_tally_and_the_clock():
    node = _node()
    node.start_step(0.1)
    node.judge(None, 1.0)
    node.trained(3.0)
    assert node.columns() == {"merged": 0, "failed": 1, "clock": 3.0} and node.tally() == (0, 0)


class _Endpoint:
    """A pull endpoint stand-in: records what is published and answers fetches with ``answer``."""

    def __init__(self, answer):
        self.answer, self.published, self.fetches = answer, [], []

    def publish(self, tensors, meta):
        self.published.append(meta)

    def fetch(self, peer, timeout, wait=0.0):
        self.fetches.append((peer, timeout, wait))
        future = Future()
        future.set_result(self.answer(peer) if callable(self.answer) else self.answer)
        return future


def test_the_process_engine_averager_drives_the_same_state_machine_on_its_clock():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    flat = FlatState(model)
    peer = {name: torch.full_like(t, 4.0) for name, t in flat.tensors().items()}
    endpoint = _Endpoint(Message(Kind.REPLY, 1, tensors=peer, meta={"clock": 3.0, "loss": 1.0}))
    clock = FakeClock(START)
    averager = GossipAverager(flat, endpoint, [1], GossipSettings(interpolation="constant", value=0.5, timeout=2.0),
                              time=clock)
    before = flat.state.clone()
    averager.update_send(2.0)
    clock.advance(0.3)  # the step takes 0.3 s on the averager's clock
    record = averager.update_wait(2.0)
    assert isinstance(averager.node, GossipState) and endpoint.fetches == [(1, 2.0, 0.0)]  # no step timed yet
    assert record["fetched"] == 1 and record["factor"] == 0.5 and "failed" not in record
    assert torch.allclose(flat.state, (before + 4.0) / 2)
    assert averager.clock == 0.5 * 3.0 + 0.5 * 1.0 and averager.merges == 1
    assert endpoint.published[-1] == {"clock": 1.0, "loss": 2.0}  # the trained state, before the merge
    averager.update_send(2.0)
    assert endpoint.fetches[-1] == (1, 2.0, pytest.approx(0.3))  # a fresh fetch waits for the timed step


def test_a_joining_node_takes_the_first_usable_peer_state_whole_with_its_clock():
    flat = FlatState(nn.Linear(2, 1))
    def state(value):
        return {name: torch.full_like(t, value) for name, t in flat.tensors().items()}
    answers = {1: None, 2: Message(Kind.REPLY, 2, tensors=state(float("nan")), meta={"clock": 9.0, "loss": 1.0}),
               3: Message(Kind.REPLY, 3, tensors=state(4.0), meta={"clock": 12.5, "loss": 1.0})}
    endpoint = _Endpoint(answers.get)
    averager = GossipAverager(flat, endpoint, [1, 2, 3], GossipSettings(timeout=2.0), time=FakeClock(START))
    problems = []
    assert averager.adopt([1, 2, 3], problems) == 12.5 and averager.clock == 12.5
    assert torch.equal(flat.state, torch.full_like(flat.state, 4.0))  # peer 3's, whole
    assert [f[0] for f in endpoint.fetches] == [1, 2, 3] and len(problems) == 2
    assert problems[0] == "1 did not answer" and problems[1].startswith("2: ") and "NaN" in problems[1], problems
    assert averager.adopt([1], problems) is None


def test_peers_that_join_are_picked_and_slots_no_one_holds_are_not():
    node = _node(peers=(1, 2, 3))
    node.scores.only([1, 3])
    node.scores.add(5)
    picked = set()
    for _ in range(60):
        picked.add(node.start_step(0.1).peer)
        node.judge(Reply(clock=1.0, loss=1.0, tensors=(torch.zeros(4),)), 1.0)
    assert picked == {1, 3, 5} and node.scores.score.keys() == {1, 3, 5}
