"""FedAvg with a parameter server: the federated baseline beside the decentralized algorithms."""

import json

import pytest

from meshlearn.algorithms.fedavg import participants, sample_weights
from meshlearn.config import make_config
from meshlearn.errors import ConfigError
from meshlearn.sim import simulate
from meshlearn.sim.report import load_logs


def test_the_drawn_share_of_nodes_is_seeded_and_changes_each_round():
    assert participants(seed=1, iteration=0, nodes=6, fraction=1.0) == [0, 1, 2, 3, 4, 5]
    rounds = [participants(1, t, 6, 0.5) for t in range(20)]
    assert all(len(r) == 3 and len(set(r)) == 3 and r == sorted(r) for r in rounds)
    assert rounds == [participants(1, t, 6, 0.5) for t in range(20)]  # every node draws the same
    assert len({tuple(r) for r in rounds}) > 5 and participants(1, 0, 6, 0.01) != []  # at least one node


def test_contributions_weigh_by_training_samples():
    assert sample_weights({0: 100.0, 3: 300.0}) == {0: 0.25, 3: 0.75}


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
    drawn = [participants(1, t, 8, 0.5) for t in range(60)]
    assert pushed == sum(len(d) - (0 in d) for d in drawn) == stats[0]["messages_received"]
