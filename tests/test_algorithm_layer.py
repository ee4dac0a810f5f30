"""The algorithm layer (``meshlearn.definitions``): rules over stacks, checked by hand, and a
user's algorithm written as one file, run by both engines."""

import queue
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers.engines import BASE, batched_states, process_engine_states
from helpers.rounds import Fixed, exchange

from meshlearn.batched import BatchedSimulation
from meshlearn.config import make_config
from meshlearn.definitions.base import DEFINITIONS, RoundAlgorithm
from meshlearn.definitions.pushsum import PushSum, PushSumSettings
from meshlearn.definitions.tracking import GradientTracking
from meshlearn.errors import ConfigError
from meshlearn.flat import FlatState
from meshlearn.node.algorithms import AlgorithmContext, make_algorithm
from meshlearn.sim.tables import load_logs
from meshlearn.topology import build_topology
from meshlearn.topology.sampling import OnePeerExponential, StaticRounds
from meshlearn.transport import Transport


class RowNormalised(RoundAlgorithm):
    """D-PSGD's rule (own weight: what the senders' leave of one) on push-sum's weights."""

    round = PushSum.round


def test_push_sum_pushes_column_stochastic_shares_by_hand():
    # 0 -> 1, 1 -> 2, 2 -> 0 and 2 -> 1: node 2 keeps a third and pushes a third to each
    rule = PushSum(Fixed([[1], [2], [0, 1]]), 3, 0)
    own = torch.tensor([[3.0], [6.0], [9.0]])
    state = rule.begin(own)
    exchange(rule, own, state, 0)
    # x: 0 keeps 3/2 and gets 9/3; 1 keeps 6/2, gets 3/2 and 9/3; 2 keeps 9/3, gets 6/2
    assert state["x"].flatten().tolist() == pytest.approx([1.5 + 3, 3 + 1.5 + 3, 3 + 3])
    assert state["w"].tolist() == pytest.approx([0.5 + 1 / 3, 0.5 + 0.5 + 1 / 3, 1 / 3 + 0.5])
    assert own.flatten().tolist() == pytest.approx((state["x"].flatten() / state["w"]).tolist())
    assert float(state["w"].sum()) == pytest.approx(3.0)  # push-sum keeps the mass


def test_push_sum_averages_exactly_on_a_directed_graph_where_plain_averaging_is_biased():
    send_to = [[1], [2], [0, 1]]
    start = torch.tensor([[3.0], [6.0], [9.0]])
    rule, own = PushSum(Fixed(send_to), 3, 0), start.clone()
    state = rule.begin(own)
    plain, plain_own = RowNormalised(Fixed(send_to), 3, 0), start.clone()
    for iteration in range(200):
        exchange(rule, own, state, iteration)
        exchange(plain, plain_own, {}, iteration)
    assert own.flatten().tolist() == pytest.approx([6.0] * 3, abs=1e-5)  # the true average
    assert abs(float(plain_own[0]) - 6.0) > 0.1  # row-normalising the pushes drifts toward node 2's


def test_push_sum_on_the_one_peer_exponential_graph_keeps_weight_one_and_is_dpsgd():
    rounds = OnePeerExponential(8)
    rule, own = PushSum(rounds, 8, 0), torch.arange(8.0).reshape(8, 1)
    state = rule.begin(own)
    for iteration in range(3):  # log2(8) rounds average exactly
        exchange(rule, own, state, iteration)
    assert state["w"].tolist() == [1.0] * 8
    assert own.flatten().tolist() == pytest.approx([3.5] * 8)


def test_push_sum_steps_the_numerator_or_the_model():
    own = torch.tensor([[2.0], [2.0]])
    for step, expected in (("numerator", 2.0 + 1.0 / 0.5), ("model", 2.0 + 1.0)):
        rule = PushSum(Fixed([[1], [0]]), 2, 0, PushSumSettings(step=step))
        state = {"x": torch.tensor([[1.0], [1.0]]), "w": torch.tensor([0.5, 0.5])}  # z = x / w = 2
        sent = rule.payload(own + 1.0, state, 0)  # the local steps moved each model by 1
        assert float(sent[0, 0]) / float(sent[0, 1]) == pytest.approx(expected)


def test_one_peer_exponential_rounds_by_hand():
    rounds = OnePeerExponential(6)
    assert rounds.hops == [1, 2, 4]
    third = rounds.round(2)
    assert third.send_to[0] == (4,) and third.receive_from[0] == (2,) and third.weights[0] == {2: 0.5}
    assert rounds.round(3) == rounds.round(0)
    assert build_topology("one-peer-exponential", 6, 0).neighbours(0) == [1, 2, 4, 5]


def _quadratic_run(cls, iterations=400, lr=0.1):
    """Nodes minimising (x - b_i)^2 / 2 on a ring, one exact gradient step per iteration: their models."""
    targets = torch.tensor([[0.0], [4.0], [1.0], [9.0], [-3.0]], dtype=torch.float64)
    rule = cls(StaticRounds(build_topology("ring", 5, 0)), 5, 0)
    own = torch.zeros(5, 1, dtype=torch.float64)
    state = rule.begin(own)
    for iteration in range(iterations):
        own -= lr * (own - targets)  # the local step
        exchange(rule, own, state, iteration)
    return own, targets


def test_gradient_tracking_is_dsgt_by_hand():
    rule = GradientTracking(StaticRounds(build_topology("full", 2, 0)), 2, 0)  # weights 1/2: W = [[.5, .5], [.5, .5]]
    own = torch.tensor([[0.0], [0.0]])
    state = rule.begin(own)
    # iteration 0: updates u0 = (1, 3); d0 = u0; x1 = W (x0 + d0) = (2, 2); W d0 = (2, 2)
    own += torch.tensor([[1.0], [3.0]])
    exchange(rule, own, state, 0)
    assert own.flatten().tolist() == [2.0, 2.0]
    # iteration 1: updates u1 = (-1, 5); d1 = W d0 + u1 - u0 = (0, 4); x2 = W (x1 + d1) = (4, 4)
    own += torch.tensor([[-1.0], [5.0]])
    exchange(rule, own, state, 1)
    assert own.flatten().tolist() == [4.0, 4.0]
    assert state["mixed"].flatten().tolist() == [2.0, 2.0]  # W d1


def test_gradient_tracking_finds_the_exact_optimum_where_dpsgd_stays_biased():
    tracked, targets = _quadratic_run(GradientTracking)
    plain, _ = _quadratic_run(RoundAlgorithm)  # D-PSGD's rule
    assert (tracked - targets.mean()).abs().max() < 1e-6
    assert (plain - targets.mean()).abs().max() > 1e-2  # heterogeneous targets: D-PSGD's nodes disagree


def test_an_algorithm_is_refused_by_its_own_declaration():
    for values, message in [
        ({"algorithm": "pushsum", "transport": "udp"}, "algorithm pushsum needs transport tcp"),
        ({"algorithm": "tracking", "aggregation": "median"}, "algorithm tracking needs aggregation mean"),
        ({"algorithm": "fedavg", "transport": "udp"}, "algorithm fedavg needs transport tcp \\(its answer is a model"),
        ({"algorithm": "pushsum", "aggregation": "median"}, "needs aggregation mean \\(a robust rule over numerators"),
        ({"algorithm": "fedavg", "byzantine": "0:sign-flip"}, "byzantine node 0 is fedavg's server"),
        ({"algorithm": "fedavg", "aggregation": "median", "fedavg_compress": "int8"}, "needs fedavg_compress none"),
        ({"algorithm": "leader", "outer": "adam"}, "with the leader needs aggregations every member takes at once"),
        # (with the dynamic algorithms a user's module registered by now listed too)
        ({"algorithm": "gossip", "topology": "one-peer-exponential"}, "needs algorithm (.* )?dpsgd, (.* )?pushsum, (.* )?tracking"),
        ({"algorithm": "tracking", "sharing": "topk:0.1"}, "needs algorithm dpsgd or local"),
        ({"algorithm": "mine"}, "unknown algorithm 'mine'"),
        # request-and-answer channels carry no user-space emulation: refused, not silently ignored
        ({"algorithm": "gossip", "net": "delay=200ms,rate=10mbit"}, "needs no emulated delay or rate on the process"),
        ({"algorithm": "leader", "net": "jitter=5ms"}, "needs no emulated jitter on the process engine")]:
        with pytest.raises(ConfigError, match=message):
            make_config(values)
    for values in ({"algorithm": "gossip", "net": "delay=200ms", "engine": "batched"},  # modelled there
                   {"algorithm": "gossip", "net": "loss=10%"},  # the kernel's drops reach every TCP connection
                   {"algorithm": "dpsgd", "net": "delay=200ms,rate=10mbit"}):
        make_config(values)
    assert make_config({"algorithm": "pushsum", "peer_sampling": "epidemic:2"}).dynamic() == "peer_sampling epidemic:2"
    assert {"pushsum", "tracking", "dpsgd"} <= set(DEFINITIONS.names())


USER_ALGORITHM = textwrap.dedent('''
    """A user's algorithm, one file: each node takes the coordinate-wise median of its own model and
    those it heard (a rule that is not a weighted sum, so the batched engine stacks what came)."""
    import torch

    from meshlearn.definitions import RoundAlgorithm, register_algorithm


    @register_algorithm
    class MedianOfPeers(RoundAlgorithm):
        name = "median-of-peers"
        summary = "coordinate-wise median of the node's and its neighbours' models"
        linear = False

        def merge_stack(self, own, state, sent, received, weights, own_weight, iteration):
            for row in range(own.shape[0]):
                heard = received[row][weights[row] > 0]
                own[row] = torch.cat([sent[row:row + 1], heard]).median(0).values
''')


@pytest.fixture()
def user_module(tmp_path):
    path = tmp_path / "my_algorithm.py"
    path.write_text(USER_ALGORITHM)
    return path


def test_a_users_algorithm_in_one_file_runs_on_both_engines_alike(tmp_path, user_module):
    values = {**BASE, "algorithm": "median-of-peers", "models_module": str(user_module)}
    expected = process_engine_states(values)
    states = batched_states(values, tmp_path, "on")
    for rank, state in enumerate(expected):
        assert torch.allclose(states[rank], state, atol=1e-5, rtol=0), rank
    assert not torch.allclose(states[0], states[1])


def test_a_users_algorithm_is_checked_against_its_declaration_from_the_command_line(tmp_path, user_module):
    # (tests/test_readme.py runs docs/extending.md's one-file algorithm on both engines from the command line)
    common = ["--models-module", str(user_module), "--nodes", "4", "--topology", "ring", "--iterations", "4"]
    refused = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--algorithm", "median-of-peers",
                              "--transport", "udp", "--output", str(tmp_path / "udp"), *common],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "algorithm median-of-peers needs transport tcp" in refused.stderr and "Traceback" not in refused.stderr
    unknown = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--algorithm", "median-of-peer",
                              "--output", str(tmp_path / "typo"), *common], capture_output=True, text=True, timeout=120)
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr
    assert "unknown algorithm 'median-of-peer'" in unknown.stderr and "median-of-peers" in unknown.stderr


class MemoryTransport(Transport):
    """Nodes of one process pushing messages through queues; messages from ``dropped`` senders are lost."""

    def __init__(self, rank, queues, dropped=()):
        super().__init__(rank)
        self.queues, self.dropped = queues, set(dropped)

    gather_timeout = 0.5

    def bind(self):
        return "memory"

    def connect(self, peers):
        pass

    def close(self):
        pass

    def send(self, peer, msg):
        if self.node_id not in self.dropped:
            self.queues[peer].put(msg)

    def recv(self, timeout):
        try:
            return self.queues[self.node_id].get(timeout=timeout)
        except queue.Empty:
            return None


def test_a_round_algorithm_runs_on_the_engines_one_runner_given_its_definition():
    from meshlearn.node.algorithms.rounds import RoundRunner

    graph = build_topology("ring", 3, 0)
    runners = [make_algorithm(name, AlgorithmContext(0, FlatState(torch.nn.Linear(2, 1)), MemoryTransport(0, {}), graph))
               for name in ("tracking", "pushsum")]
    assert [type(runner) for runner in runners] == [RoundRunner, RoundRunner]  # no class made per definition
    assert [type(runner.rules) for runner in runners] == [GradientTracking, PushSum]
    assert [runner.name for runner in runners] == ["tracking", "pushsum"]


@pytest.mark.parametrize("engine", ["process", "batched"])
def test_a_payload_that_does_not_come_leaves_its_weight_with_the_node_as_dpsgd_does(engine, tmp_path):
    """Identical models averaged with one neighbour's payload missing stay where they are (D-PSGD's
    rule keeps the weights summing to one), for both engines' round runners."""
    graph = build_topology("ring", 4, 0)
    start = torch.full((4, 3), 2.0)
    if engine == "process":
        queues = {rank: queue.Queue() for rank in range(4)}
        runners = []
        for rank in range(4):
            flat = FlatState(torch.nn.Linear(2, 1))  # 3 values, all 2.0
            flat.state.data.copy_(start[rank])
            ctx = AlgorithmContext(rank, flat, MemoryTransport(rank, queues, dropped={0}), graph, seed=0)
            runners.append(make_algorithm("tracking", ctx))
        with ThreadPoolExecutor(4) as pool:
            records = list(pool.map(lambda runner: runner.after_local_steps(0), runners))
        assert [record["missing"] for record in records] == [0, 1, 0, 1]  # 0's neighbours (ring) lost its message
        states = torch.stack([r.ctx.flat.state for r in runners])
        assert [r.watch.report()["peers"] for r in runners] == [{}] * 4  # nothing refused: 0's messages lost
    else:
        config = make_config({**BASE, "nodes": 4, "topology": "ring", "algorithm": "tracking", "rounds": 1, "lr": 1e-9,
                              "iterations": 2, "slowdown": "0:+5s", "wait_timeout": 0.5, "engine": "batched",
                              "step_time": 0.001})
        (tmp_path / "logs").mkdir()
        simulation = BatchedSimulation(config, graph, tmp_path / "logs")
        simulation.run()
        states = simulation.stacked.state
        start = states[:1].expand_as(states).clone()  # one model at the start, steps of lr 1e-9
        late = load_logs(tmp_path)[1]
        assert [e["missing"] for e in late if e.get("event") == "iteration"][:1] == [1]  # node 0 was late
    assert torch.allclose(states, start[:, :states.shape[1]], atol=1e-6), states
