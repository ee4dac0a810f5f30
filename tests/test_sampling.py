"""Dynamic topologies: a new graph every round, and Epidemic Learning, drawn from the run's seed."""

import json

import pytest
import torch
from helpers.engines import metropolis_average

from meshlearn.batched.mixing import Links
from meshlearn.config import make_config
from meshlearn.errors import ConfigError
from meshlearn.sim import simulate
from meshlearn.topology.sampling import PeerSampler, Round


def test_a_new_regular_graph_every_round_the_same_on_every_node():
    sampler, elsewhere = PeerSampler("graph", "regular:3", 12, seed=4), PeerSampler("graph", "regular:3", 12, seed=4)
    rounds = [sampler.round(t) for t in range(5)]
    assert rounds == [elsewhere.round(t) for t in range(5)]  # every node draws the same rounds
    assert len({r.send_to for r in rounds}) == 5  # a different graph each round
    for r in rounds:
        assert r.send_to == r.receive_from and all(len(peers) == 3 for peers in r.send_to)
        assert all(i in r.send_to[j] for i in range(12) for j in r.send_to[i])  # undirected
        # the round's own Metropolis-Hastings weights: 1 / (1 + max(3, 3))
        assert all(w == pytest.approx(0.25) for weights in r.weights for w in weights.values())
    assert PeerSampler("graph", "regular:3", 12, seed=5).round(0) != rounds[0]


def test_epidemic_learning_sends_to_s_others_and_averages_equally():
    sampler = PeerSampler("epidemic:2", "regular:3", 6, seed=1)
    met = set()
    for t in range(100):
        r = sampler.round(t)
        for i, targets in enumerate(r.send_to):
            assert len(set(targets)) == 2 and i not in targets
            met.update((i, j) for j in targets)
        for j, senders in enumerate(r.receive_from):
            assert sorted(senders) == [i for i in range(6) if j in r.send_to[i]]
            assert r.weights[j] == {i: 1 / (1 + len(senders)) for i in senders}
    assert len(met) == 30  # every ordered pair met in 100 rounds: uniform over the others


def test_a_rounds_links_average_what_each_node_received_by_hand():
    # node 0 sends to 1; node 1 to 0 and 2; node 2 to 1: node 1 hears two, the others one
    exchange = Round(send_to=((1,), (0, 2), (1,)), receive_from=((1,), (0, 2), (1,)),
                     weights=({1: 1 / 2}, {0: 1 / 3, 2: 1 / 3}, {1: 1 / 2}))
    state = torch.tensor([[1.0], [4.0], [7.0]])
    state = metropolis_average(Links.of_round(exchange), state)
    assert torch.allclose(state, torch.tensor([[2.5], [4.0], [5.5]]))


def test_graph_rounds_use_that_rounds_metropolis_hastings_weights():
    sampler = PeerSampler("graph", "erdos:0.4", 10, seed=2)
    r = sampler.round(3)
    neighbours = [len(p) for p in r.receive_from]
    assert len(set(neighbours)) > 1  # erdos: degrees differ, so do the weights
    for i, weights in enumerate(r.weights):
        for j, w in weights.items():
            assert w == pytest.approx(1 / (1 + max(neighbours[i], neighbours[j])))


@pytest.mark.parametrize("values,message", [
    ({"peer_sampling": "graph", "topology": "ring"}, "from a random topology"),
    ({"peer_sampling": "epidemic:8"}, "S from 1 to 7"), ({"peer_sampling": "sometimes"}, "use off, graph"),
    ({"peer_sampling": "graph", "algorithm": "gossip"}, "needs algorithm (.* )?dpsgd"),
    ({"peer_sampling": "epidemic:2", "transport": "udp"}, "needs transport tcp"),
])
def test_a_dynamic_topology_that_cannot_be_run_is_one_clear_error(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config(values)


def test_quick_digits_runs_learn_with_a_new_graph_each_round_and_with_epidemic_learning(tmp_path):
    summaries = {}
    for sampling in ("off", "graph", "epidemic:2"):
        config = make_config({"engine": "batched", "nodes": 8, "dataset": "digits", "iterations": 100, "lr": 0.1,
                              "test_after": 100, "step_time": 0.001, "seed": 1, "peer_sampling": sampling,
                              "output": str(tmp_path / sampling)})
        simulate(config, progress=False)
        summaries[sampling] = json.loads((tmp_path / sampling / "summary.json").read_text())
    for sampling, summary in summaries.items():
        assert summary["final"]["accuracy"] >= summaries["off"]["final"]["accuracy"] - 0.02, sampling
    # epidemic:2 sends 2 models a round where the 3-regular graph sends 3
    assert summaries["epidemic:2"]["bytes_sent"] == pytest.approx(summaries["off"]["bytes_sent"] * 2 / 3)
    resolved = (tmp_path / "epidemic:2" / "config.yaml").read_text()
    assert "peer_sampling: epidemic:2" in resolved
