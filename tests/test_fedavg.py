"""FedAvg with a parameter server: the federated baseline beside the decentralized algorithms."""

import json

import pytest
import torch

from meshlearn.config import make_config
from meshlearn.definitions.fedavg import FedAvg, participants
from meshlearn.definitions.settings import drawn as count_of
from meshlearn.errors import ConfigError
from meshlearn.sim import simulate
from meshlearn.sim.tables import load_logs


def test_the_drawn_share_of_nodes_is_seeded_and_changes_each_round():
    assert participants(seed=1, iteration=0, nodes=6, count=6) == [0, 1, 2, 3, 4, 5]
    rounds = [participants(1, t, 6, count_of(0.5, 6)) for t in range(20)]
    assert all(len(r) == 3 and len(set(r)) == 3 and r == sorted(r) for r in rounds)
    assert rounds == [participants(1, t, 6, count_of(0.5, 6)) for t in range(20)]  # every node draws the same
    assert len({tuple(r) for r in rounds}) > 5 and participants(1, 0, 6, count_of(0.01, 6)) != []  # at least one node


def test_contributions_weigh_by_the_partitions_shard_sizes():
    # the sizes are the seeded partition's, which the server computes: nothing a client claims
    server = FedAvg(None, 4, seed=1, shard_sizes=[100, 5, 5, 300], ranks=[0])
    push = server.exchange(0, 0)  # phase 0: every node drawn (fraction 1), 1-3 push to node 0
    assert push.round.receive_from[0] == (1, 2, 3) and push.own_weights == (100.0,) and not push.keeps_missing
    own, state = torch.tensor([[4.0]]), server.begin(torch.tensor([[4.0]]))
    sent = server.payload(own, state, push)
    node_3 = torch.tensor([[8.0, 1.0]])  # its model and the trailing 1, with node 3's weight; 1 and 2 did not come
    server.merge(own, state, sent * 100.0 + node_3 * push.round.weights[0][3], push)
    assert float(own[0, 0]) == 0.25 * 4.0 + 0.75 * 8.0  # by samples over what came: 100 and 300
    assert participants(1, 0, 100, count_of(0.07, 100)) == sorted(set(participants(1, 0, 100, count_of(0.07, 100)))) and \
        len(participants(1, 0, 100, count_of(0.07, 100))) == 7  # 0.07 * 100 is 7.000000000000001 in floats: still 7


def test_each_exchange_is_a_value_no_earlier_call_changes():
    # the push and the answer of an iteration, asked in either order, again, or after another iteration's
    from meshlearn.definitions.settings import FedAvgSettings

    rules = FedAvg(None, 6, seed=1, settings=FedAvgSettings(fraction=0.5), shard_sizes=[10, 20, 30, 40, 50, 60],
                   ranks=range(6))
    drawn = {t: participants(1, t, 6, count_of(0.5, 6)) for t in range(20)}
    with_server, without = (next(t for t in drawn if (0 in drawn[t]) is wanted) for wanted in (True, False))
    answer = rules.exchange(with_server, 1)
    pushes = {t: rules.exchange(t, 0) for t in (without, with_server)}
    assert rules.exchange(with_server, 1) == answer and rules.exchange(with_server, 0) == pushes[with_server]
    assert pushes[with_server].own_weights[0] == 10.0 and pushes[without].own_weights[0] == 0.0  # the server's samples
    assert pushes[without].own_weights[1:] == (1.0,) * 5 and not pushes[without].keeps_missing
    assert answer.own_weights == (1.0,) + (0.0,) * 5 and answer.keeps_missing  # a client keeps its own only if unheard
    assert pushes[without].round.receive_from[0] == tuple(drawn[without])


def test_the_server_knows_every_shard_size_from_the_partition_and_needs_them(tmp_path):
    from dataclasses import replace

    from meshlearn.data import load_dataset, partition_dataset
    from meshlearn.node import build_node
    from meshlearn.node.algorithms import make_algorithm
    from meshlearn.topology import build_topology

    config = make_config({"algorithm": "fedavg", "nodes": 3, "topology": "full", "partition": "dirichlet:0.5",
                          "seed": 4, "output": str(tmp_path)})
    node = build_node(config, 0, build_topology("full", 3, seed=4))
    try:
        sizes = [len(p) for p in partition_dataset(load_dataset("digits"), 3, "dirichlet:0.5", 4)]
        assert len(set(sizes)) == 3 and node.algorithm.ctx.shard_sizes == tuple(sizes)
        with pytest.raises(ConfigError, match="shard sizes"):
            make_algorithm("fedavg", replace(node.algorithm.ctx, shard_sizes=()))
    finally:
        node.transport.close()


def test_fedavg_that_cannot_be_run_is_one_clear_error():
    with pytest.raises(ConfigError, match="algorithm fedavg needs transport tcp"):
        make_config({"algorithm": "fedavg", "transport": "udp"})
    with pytest.raises(ConfigError, match="fedavg_fraction"):
        make_config({"algorithm": "fedavg", "fedavg_fraction": 0})


def test_a_quick_federated_run_learns_and_the_server_answers_everyone(tmp_path):
    config = make_config({"engine": "batched", "nodes": 8, "dataset": "digits", "iterations": 60, "lr": 0.1,
                          "test_after": 60, "step_time": 0.001, "seed": 1, "algorithm": "fedavg",
                          "fedavg_fraction": 0.5, "output": str(tmp_path)})
    simulate(config, progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final"]["accuracy"] > 0.8 and summary["final"]["accuracy_std"] == 0  # one global model
    stats = {rank: events[-1]["stats"] for rank, events in load_logs(tmp_path).items()}
    assert stats[0]["messages_sent"] == 60 * 7  # the server answers the 7 others every round
    # 4 of 8 nodes are drawn each round; those other than the server push to it
    pushed = sum(s["messages_sent"] for rank, s in stats.items() if rank != 0)
    drawn = [participants(1, t, 8, count_of(0.5, 8)) for t in range(60)]
    assert pushed == sum(len(d) - (0 in d) for d in drawn) == stats[0]["messages_received"]


@pytest.mark.parametrize("engine", ["process", "batched"])
def test_nodes_not_drawn_for_a_round_skip_its_local_steps(tmp_path, engine, monkeypatch):
    from meshlearn.batched.models import NodeModels

    trained_rows = []
    gradients = NodeModels.gradients
    monkeypatch.setattr(NodeModels, "gradients",
                        lambda self, batches: trained_rows.append(sum(len(b.ranks) for b in batches))
                        or gradients(self, batches))
    config = make_config({"engine": engine, "nodes": 8, "iterations": 4, "rounds": 2, "algorithm": "fedavg",
                          "fedavg_fraction": 0.25, "dataset": "digits", "model": "mlp", "test_after": 4,
                          "seed": 5, "step_time": 0.001, "output": str(tmp_path)})
    simulate(config, progress=False)
    for iteration in range(4):
        drawn = participants(5, iteration, 8, count_of(0.25, 8))
        records = {rank: event for rank, events in load_logs(tmp_path).items() for event in events
                   if event["event"] == "iteration" and event["iteration"] == iteration}
        # the batched engine's log names the round's participants (the server and the drawn), the process
        # engine's every node
        assert len(drawn) == 2 and len(records) == (8 if engine == "process" else len({0, *drawn}))
        for rank, event in records.items():
            assert (event["train_loss"] is not None) == (rank in drawn), (iteration, rank)
            assert (event["train"] > 0) == (rank in drawn)
    if engine == "batched":
        assert trained_rows == [2] * (4 * 2)  # two drawn nodes a step, two steps an iteration


def test_with_an_optimizer_that_steps_every_row_together_every_node_trains(tmp_path):
    config = make_config({"engine": "batched", "nodes": 6, "iterations": 2, "algorithm": "fedavg",
                          "fedavg_fraction": 0.5, "optimizer": "adam", "lr": 0.01, "dataset": "digits",
                          "model": "mlp", "step_time": 0.001, "output": str(tmp_path)})
    simulate(config, progress=False)
    iterations = [e for events in load_logs(tmp_path).values() for e in events if e["event"] == "iteration"]
    assert len(iterations) == 12 and all(e["train_loss"] is not None for e in iterations)
