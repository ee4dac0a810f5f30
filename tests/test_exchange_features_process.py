"""The exchange features (robust rules, bad nodes, a lossy transport) on the process engine's one
round runner, for every round algorithm whose declaration takes them: FedAvg's server under a
robust rule, push-sum's and gradient tracking's bad nodes forging their payloads, and a user's
algorithm over lossy UDP with a robust rule. Nodes are threads of this process on real loopback
sockets (``run_threads``); the models are the digits MLP, for one to three iterations."""

from __future__ import annotations

import pytest
import torch

from meshlearn.aggregation import get_rule
from meshlearn.config import make_config
from meshlearn.definitions import Needs, RoundAlgorithm
from meshlearn.definitions.base import DEFINITIONS
from meshlearn.definitions.fedavg import participants
from meshlearn.definitions.settings import drawn as count_of
from meshlearn.errors import ConfigError
from meshlearn.flat import FlatState
from meshlearn.node import build_node
from meshlearn.node.algorithms import AlgorithmContext, make_algorithm
from meshlearn.sim.inprocess import run_threads
from meshlearn.topology import build_topology
from meshlearn.transport import Transport

SMALL = {"dataset": "digits", "model": "mlp", "rounds": 1, "batch_size": 16, "lr": 0.05, "test_after": 100,
         "wait_timeout": 60}
FLIP = 10.0  # sign-flip:10: a bad node sends -10 times its payload


def build(values: dict) -> list:
    """The configuration's process-engine nodes (not yet bound)."""
    config = make_config({**SMALL, **values})
    graph = build_topology(config.topology, config.nodes, config.seed)
    return [build_node(config, rank, graph) for rank in range(config.nodes)]


def record_payloads(node) -> list[tuple[int, int, torch.Tensor]]:
    """What ``node``'s definition makes as its honest payload of each exchange (iteration, phase,
    payload [Q]), recorded as the runner asks for it."""
    made, payload = [], node.algorithm.rules.payload

    def recording(own, state, exchange):
        sent = payload(own, state, exchange)
        made.append((exchange.iteration, exchange.phase, sent[0].clone()))
        return sent

    node.algorithm.rules.payload = recording
    return made


def record_sent(node) -> list[torch.Tensor]:
    """Every payload [Q] ``node`` puts on the wire to at least one peer, in order."""
    sent, broadcast = [], node.transport.broadcast

    def recording(peers, msg):
        if list(peers) and msg.tensors:
            sent.append(torch.cat([tensor.reshape(-1) for tensor in msg.tensors.values()]).clone())
        return broadcast(peers, msg)

    node.transport.broadcast = recording
    return sent


# --- FedAvg's server under a robust rule -------------------------------------------------------------

BAD_CLIENT = 3


def server_not_drawn(nodes: int, fraction: float) -> int:
    """A seed whose first round draws the bad client and another client, not the server."""
    for seed in range(1000):
        drawn = participants(seed, 0, nodes, count_of(fraction, nodes))
        if 0 not in drawn and BAD_CLIENT in drawn and len(drawn) >= 3:
            return seed
    raise AssertionError("no such seed")


@pytest.mark.parametrize("fraction", [1.0, 0.6])
def test_fedavgs_server_takes_the_robust_rule_over_the_drawn_clients_where_the_mean_is_dragged_away(fraction):
    """One iteration: the server's aggregate under the median is the median of the payloads it
    pooled (its own only where it was drawn; the bad client's flipped model in place of its
    model, the trailing 1 the server checks sent as it is), inside the honest payloads' range in
    every coordinate; under the mean the flip drags it far off. Every node ends with the server's
    answer."""
    nodes = 5
    seed = 2 if fraction == 1.0 else server_not_drawn(nodes, fraction)
    drawn = participants(seed, 0, nodes, count_of(fraction, nodes))
    assert (0 in drawn) == (fraction == 1.0)
    finals = {}
    for rule in ("median", "mean"):
        run = build({"algorithm": "fedavg", "nodes": nodes, "topology": "full", "iterations": 1, "seed": seed,
                     "fedavg_fraction": fraction, "aggregation": rule, "byzantine": f"{BAD_CLIENT}:sign-flip:{FLIP:g}"})
        payloads = {node.rank: record_payloads(node) for node in run}
        forged = record_sent(run[BAD_CLIENT])
        run_threads(run, timeout=120)
        pushed = {rank: next(p for _, phase, p in made if phase == 0) for rank, made in payloads.items()}
        assert len(forged) == 1 and torch.equal(forged[0][:-1], -FLIP * pushed[BAD_CLIENT][:-1])  # one push
        assert float(forged[0][-1]) == 1.0  # the trailing 1 as it is: a payload with another is refused
        final = finals[rule] = run[0].flat.state.clone()
        assert all(torch.equal(node.flat.state, final) for node in run)  # everyone took the server's answer
        lo, hi = torch.stack([pushed[j][:-1] for j in drawn if j != BAD_CLIENT]).aminmax(dim=0)
        inside = float(((final >= lo - 1e-6) & (final <= hi + 1e-6)).float().mean())
        if rule == "median":
            pooled = torch.stack([forged[0] if j == BAD_CLIENT else pushed[j] for j in drawn])
            expected = get_rule("median")(pooled, [1.0] * len(drawn))
            assert float(expected[-1]) == 1.0  # the payload's trailing 1 comes through the rule
            assert torch.allclose(final, expected[:-1], atol=1e-6)
            assert inside == 1.0
        else:
            assert inside < 0.5
    assert float((finals["mean"] - finals["median"]).norm()) > float(finals["median"].norm())  # farther off than the model is long


# --- push-sum's and gradient tracking's bad nodes forge their payloads --------------------------------

BAD = 1


@pytest.mark.parametrize("algorithm", ["pushsum", "tracking"])
@pytest.mark.parametrize("attack", [f"sign-flip:{FLIP:g}", "stale"])
def test_a_bad_node_sends_what_its_attack_forges_from_its_payload(algorithm, attack):
    """Push-sum's payload is [x, w], tracking's [x + d, d]: a sign-flipper sends -10 times it, a
    stale node its first payload every iteration; its honest neighbours merge what it sent."""
    run = build({"algorithm": algorithm, "nodes": 4, "topology": "ring", "iterations": 3, "seed": 5,
                 "byzantine": f"{BAD}:{attack}"})
    payloads, sent = record_payloads(run[BAD]), record_sent(run[BAD])
    run_threads(run, timeout=120)
    honest = [payload for _, _, payload in payloads]
    assert len(sent) == len(honest) == 3
    size = run[BAD].flat.state.numel()
    assert all(p.numel() == (size + 1 if algorithm == "pushsum" else 2 * size) for p in honest)
    for iteration, (forged, payload) in enumerate(zip(sent, honest)):
        expected = -FLIP * payload if attack.startswith("sign-flip") else honest[0]
        assert torch.allclose(forged, expected), iteration
    assert not torch.allclose(honest[0], honest[-1])  # its honest payload moved on: stale really is stale
    for rank in build_topology("ring", 4, 5).neighbours(BAD):
        report = run[rank].algorithm.peers_report()
        assert str(BAD) not in report["peers"] or report["peers"][str(BAD)]["refused"] == 0  # merged, not refused


def test_a_push_sum_neighbour_merges_the_forged_weight():
    """Ring of four, shares of a third: after one round a neighbour of the sign-flipper holds
    w = 1/3 + 1/3 - 10/3, what the forged [x, w] gives; the node across the ring, w = 1."""
    run = build({"algorithm": "pushsum", "nodes": 4, "topology": "ring", "iterations": 1, "seed": 5,
                 "byzantine": f"{BAD}:sign-flip:{FLIP:g}"})
    run_threads(run, timeout=120)
    weights = [float(node.algorithm.state["w"][0]) for node in run]
    for rank in build_topology("ring", 4, 5).neighbours(BAD):
        assert weights[rank] == pytest.approx((2 - FLIP) / 3)
    assert weights[(BAD + 2) % 4] == pytest.approx(1.0)


# --- a user's algorithm declaring lossy, robust and byzantine ----------------------------------------


class HalfwayToTheMix(RoundAlgorithm):
    """A user's algorithm: each node moves half way to what its exchange mixed (the weighted sum,
    or the run's robust rule, per chunk of what arrived over UDP)."""

    name = "halfway-test"
    summary = "half way to the mix: a test's algorithm"
    needs = Needs(lossy=True, robust=True, byzantine=True)

    def merge(self, own, state, mixed, exchange):
        own.lerp_(mixed, 0.5)


class OwnStackRule(HalfwayToTheMix):
    """A user's algorithm merging a stack by its own rule (no weighted sum a robust rule could replace)."""

    name = "own-stack-test"
    linear = False


class Unsent(Transport):
    """A transport that is never connected: for building a runner only."""

    gather_timeout = 0.1

    def bind(self):
        return "nowhere"

    def connect(self, peers):
        pass

    def close(self):
        pass

    def send(self, peer, msg):
        raise AssertionError("nothing is sent")

    def recv(self, timeout):
        return None


class LossyUnsent(Unsent):
    lossy = True


@pytest.fixture()
def users_algorithms(monkeypatch):
    for cls in (HalfwayToTheMix, OwnStackRule):
        monkeypatch.setitem(DEFINITIONS._items, cls.name, cls)


def test_a_users_algorithm_runs_over_lossy_udp_with_a_robust_rule_and_resists_a_bad_node(users_algorithms):
    """Six nodes over UDP losing a fifth of their datagrams, one sign-flipper: with self-centred
    clipping (radius 0.5, per chunk of what arrived) the honest nodes stay near where they started;
    with the mean the bad node's forged models drag them far off. Chunks really were lost. (A rule
    such as the median is no defence where a chunk came only from the bad node: it is then the
    mean of two.)"""
    init = None
    drift = {}
    for rule in ("clip:0.5", "mean"):
        run = build({"algorithm": "halfway-test", "nodes": 6, "topology": "regular:3", "iterations": 3, "seed": 11,
                     "transport": "udp", "net": "loss=20%", "udp_timeout": 0.3, "chunk_bytes": 1424,
                     "aggregation": rule, "byzantine": f"{BAD}:sign-flip:{FLIP:g}"})
        init = run[0].flat.state.clone() if init is None else init
        run_threads(run, timeout=120)
        assert sum(node.transport.extra_stats()["chunks_lost"] for node in run) > 0
        honest = [node.flat.state for node in run if node.rank != BAD]
        drift[rule] = max(float((state - init).norm()) for state in honest) / float(init.norm())
    assert drift["clip:0.5"] < 0.2 and drift["mean"] > 1, drift


def test_a_robust_rule_or_udp_is_refused_where_the_definition_merges_by_its_own_rule(users_algorithms):
    graph = build_topology("ring", 3, 0)
    for transport, rule, what in ((Unsent(0), "median", "use aggregation mean"),
                                  (LossyUnsent(0), "mean", "use transport tcp")):
        ctx = AlgorithmContext(0, FlatState(torch.nn.Linear(2, 1)), transport, graph, rule=rule)
        with pytest.raises(ConfigError, match=f"own-stack-test with these settings merges by its own rule.*{what}"):
            make_algorithm("own-stack-test", ctx)
