"""A D-PSGD group that takes in a member as it runs (a network task's newcomer): the rounds every
member agrees on (``GrowingRounds``), and the process engine's nodes on real sockets taking one in.
(Between real providers: tests/test_network_join.py.)"""

from __future__ import annotations

import threading

import pytest
import torch

from meshlearn.config import load_run_dataset, make_config
from meshlearn.data import partition_dataset
from meshlearn.errors import TopologyError
from meshlearn.models import build_model
from meshlearn.node import Node
from meshlearn.node.factory import make_transport
from meshlearn.topology import build_topology
from meshlearn.topology.sampling import GrowingRounds


def test_a_newcomer_listens_the_round_before_it_joins_and_every_round_has_its_members_weights():
    rounds = GrowingRounds([0, 1, 2])
    before = rounds.round(0)
    assert before.send_to == ((1, 2), (0, 2), (0, 1))
    assert before.weights[0] == {1: 1 / 3, 2: 1 / 3}  # the complete graph of three: a third each
    rounds.join(3, at=4)
    listening = rounds.round(3)
    assert listening.send_to[0] == (1, 2, 3) and listening.receive_from[0] == (1, 2)  # 3 hears, says nothing
    assert listening.receive_from[3] == (0, 1, 2) and listening.send_to[3] == ()
    assert listening.weights[3] == {0: 1 / 3, 1: 1 / 3, 2: 1 / 3}  # its own (first) model weighs nothing
    assert listening.weights[0] == before.weights[0]
    joined = rounds.round(4)
    assert joined.receive_from[3] == (0, 1, 2) and joined.send_to[3] == (0, 1, 2)
    assert all(joined.weights[i] == {j: 0.25 for j in range(4) if j != i} for i in range(4))
    assert rounds.members(3) == {0, 1, 2} and rounds.members(4) == {0, 1, 2, 3}


def test_a_join_at_a_round_already_begun_is_refused():
    rounds = GrowingRounds([0, 1, 2])
    rounds.round(5)
    with pytest.raises(TopologyError, match="round 5 has begun here"):
        rounds.join(3, at=6)  # it would have listened in round 5, which was sent without it
    with pytest.raises(TopologyError, match="is a member already"):
        rounds.join(1, at=9)
    rounds.join(3, at=7)
    assert rounds.members(7) == {0, 1, 2, 3}


def test_a_newcomer_in_a_lost_members_place_takes_the_next_rank_and_the_lost_one_weighs_as_a_silent_member():
    rounds = GrowingRounds([0, 1, 2])  # 2 was lost: every member keeps it (its weight stays with each one's own)
    rounds.join(3, at=2)
    joined = rounds.round(2)
    assert len(joined.send_to) == 4 and joined.receive_from[3] == (0, 1, 2)
    assert joined.weights[0] == {1: 0.25, 2: 0.25, 3: 0.25}


def test_a_provider_in_a_lost_ones_place_trains_on_its_shard():
    from meshlearn.errors import BadMessage
    from meshlearn.network.task.spec import Peer, TaskSpec

    peers = [Peer(id=f"p{i}", address=f"tcp://127.0.0.1:{9000 + i}") for i in range(3)]
    spec = TaskSpec(task_id="t", model="mlp", epochs=1, batch_size=8, lr=0.1, algorithm="dpsgd", aggregate_every=1,
                    seed=1, partition="iid", eval_samples=0, peer_timeout=5, data={}, slots=3,
                    peers=[*peers, Peer(id="spare", address="tcp://127.0.0.1:9009", shard=1)])
    assert [spec.shard_of(i) for i in range(4)] == [0, 1, 2, 1] and spec.shards == 3
    assert spec.experiment_config(100, "127.0.0.1", "cpu", 64).nodes == 4  # ranks 0..3
    bad = spec.model_copy(update={"peers": [*peers, Peer(id="x", address="tcp://127.0.0.1:1", shard=5)]})
    with pytest.raises(BadMessage, match="provider 3 has no shard"):
        bad.shard_of(3)


def test_three_nodes_on_real_sockets_take_in_a_fourth_at_a_round_and_all_end_with_one_model():
    """Three D-PSGD nodes (TCP on loopback, threads of this process) train; at round 1 node 0 has
    every member take in node 3 at round 6; node 3 starts from the model the members hold after
    round 5 (a complete graph's members hold the same one) and every node ends with the same model."""
    config = make_config({"nodes": 4, "topology": "full", "dataset": "digits", "model": "mlp", "iterations": 12,
                          "batch_size": 16, "lr": 0.05, "test_after": 100, "seed": 3, "wait_timeout": 30})
    graph = build_topology("full", 4, config.seed)
    dataset = load_run_dataset(config)
    parts = partition_dataset(dataset, 4, config.partition, config.seed)

    def node(rank: int, joining: bool = False) -> Node:
        torch.manual_seed(config.seed)
        model = build_model(config.model, dataset.input_shape, dataset.num_classes)
        return Node(rank, config, graph, dataset, parts[rank], model,
                    lambda flat: make_transport(config, rank, flat, "127.0.0.1", 0), joining=joining,
                    members=(0, 1, 2))

    members, newcomer = [node(rank) for rank in range(3)], node(3, joining=True)
    book = {n.rank: n.transport.bind() for n in [*members, newcomer]}
    held: dict[str, torch.Tensor] = {}

    def take_in(_node: Node, iteration: int, _record: dict) -> None:
        if iteration == 1:
            for member in members:
                member.algorithm.add_member(3, book[3], at=6)
            newcomer.algorithm.join_round = 6
            threads.append(_start(newcomer, {j: book[j] for j in range(3)}, errors))
        if iteration == 5:
            held["after round 5"] = _node.flat.state.clone()

    def first_round(original):
        def before_local_steps(iteration: int) -> None:
            held.setdefault("newcomer at its first round", newcomer.flat.state.clone())
            held.setdefault("its first round", iteration)
            original(iteration)
        return before_local_steps

    newcomer.algorithm.before_local_steps = first_round(newcomer.algorithm.before_local_steps)
    members[0].hooks.append(take_in)
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []
    threads += [_start(m, {j: book[j] for j in range(3) if j != m.rank}, errors) for m in members]
    for thread in list(threads):
        thread.join(120)
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert held["its first round"] == 6
    assert torch.allclose(held["newcomer at its first round"], held["after round 5"], atol=1e-6)
    final = [n.flat.state for n in [*members, newcomer]]
    assert all(torch.allclose(final[0], state, atol=1e-6) for state in final[1:])
    assert all(n.transport.stats.unknown_sender_dropped == 0 for n in [*members, newcomer])


def _start(node: Node, peers: dict[int, str], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            node.run(peers)
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    thread = threading.Thread(target=run, name=f"node-{node.rank}", daemon=True)
    thread.start()
    return thread
