"""Several exchanges an iteration (``mixing_steps``), plain and accelerated: the payload averaged K
times by hand, the accelerated recurrence by hand, GT-Adam on a ring with enough accelerated
exchanges against one model trained on the union of the nodes' batches (both engines), the engines
against each other, and the settings refused."""

import math

import numpy as np
import pytest
import torch
from helpers.engines import BASE, batched_states, process_engine_states
from test_adaptive import EXACT, one_model_on_the_union

from meshlearn.config import make_config
from meshlearn.definitions.dpsgd import DpsgdDefinition
from meshlearn.definitions.exchange import phases
from meshlearn.definitions.mixing import MixingSettings, RepeatedMixing, with_mixing
from meshlearn.errors import ConfigError
from meshlearn.topology import build_topology
from meshlearn.topology.sampling import StaticRounds


def weight_matrix(rounds: StaticRounds, nodes: int) -> torch.Tensor:
    """The round's weights as a dense matrix, each node's own weight what its senders leave."""
    matrix = torch.zeros(nodes, nodes, dtype=torch.float64)
    for i, row in enumerate(rounds.round(0).weights):
        for j, weight in row.items():
            matrix[i, j] = weight
        matrix[i, i] = 1.0 - sum(row.values())
    return matrix


def mixed_by_matrix(rule, own: torch.Tensor, state: dict, matrix: torch.Tensor, iteration: int = 0) -> list:
    """One iteration's exchanges as the engines order them (``phases``), every payload arriving:
    each node's merge takes ``matrix @ payload``. The payloads sent, in order."""
    sent = []

    def one(exchange, tag, made):
        payload = rule.payload(own, state, exchange)
        sent.append(payload.clone())
        rule.merge(own, state, matrix @ payload, exchange)
        return {"received": 1}

    counts = phases(rule, iteration, one)
    assert counts == {"received": rule.phases}  # every exchange counted
    return sent


def test_plain_steps_average_the_payload_as_often_by_hand():
    rounds = StaticRounds(build_topology("ring", 5, 0))
    W = weight_matrix(rounds, 5)
    assert torch.allclose(W.sum(0), torch.ones(5, dtype=torch.float64)) and W[0, 2] == 0
    assert with_mixing(DpsgdDefinition(rounds, 5, 0), MixingSettings()).phases == 1  # one step: the definition
    rule = with_mixing(DpsgdDefinition(rounds, 5, 0), MixingSettings(steps=3))
    assert isinstance(rule, RepeatedMixing) and rule.phases == 3 and rule.momentum == 0
    torch.manual_seed(0)
    own = torch.randn(5, 4, dtype=torch.float64)
    first = own.clone()
    sent = mixed_by_matrix(rule, own, {}, W)
    assert [tuple(s.shape) for s in sent] == [(5, 4)] * 3
    assert torch.allclose(sent[1], W @ first) and torch.allclose(sent[2], W @ W @ first)
    assert torch.allclose(own, W @ W @ W @ first)  # the merge took the third mix, not the first
    assert torch.allclose(own.mean(0), first.mean(0))


def test_accelerated_steps_follow_the_recurrence_with_the_spectrum_of_the_weights():
    """A ring of six weighs each neighbour 1/3: eigenvalues 1/3 + 2/3 cos(2πk/6), the second in
    magnitude 2/3, so η = (1 - sqrt(5)/3) / (1 + sqrt(5)/3); p_{k+1} = (1 + η) W p_k - η p_{k-1}."""
    rounds = StaticRounds(build_topology("ring", 6, 0))
    W = weight_matrix(rounds, 6)
    assert sorted(np.abs(np.linalg.eigvalsh(W.numpy())).round(9))[-2] == pytest.approx(2 / 3)
    eta = (1 - math.sqrt(5) / 3) / (1 + math.sqrt(5) / 3)
    rule = with_mixing(DpsgdDefinition(rounds, 6, 0), MixingSettings(steps=5, accelerated=True))
    assert rule.momentum == pytest.approx(eta, abs=1e-12)
    torch.manual_seed(1)
    own = torch.randn(6, 3, dtype=torch.float64)
    before, now = own.clone(), own.clone()
    for _ in range(5):
        before, now = now, (1 + eta) * (W @ now) - eta * before
    plain = torch.linalg.matrix_power(W, 5) @ own
    first = own.clone()
    mixed_by_matrix(rule, own, {}, W)
    assert torch.allclose(own, now, rtol=0, atol=1e-12)
    assert torch.allclose(own.mean(0), first.mean(0))  # the average is kept
    spread, plain_spread = (own - own.mean(0)).norm(), (plain - plain.mean(0)).norm()
    assert spread < plain_spread / 3  # and the disagreement shrinks faster than by W^5
    mixed_by_matrix(rule, own, {}, W, iteration=1)  # the next iteration starts from its own payload again
    assert (own - own.mean(0)).norm() < spread


RING = {**EXACT, "nodes": 6, "topology": "ring"}
ACCELERATED = {**RING, "mixing_steps": 16, "mixing_accelerated": True}  # sqrt(η) = 0.38 a step: 2e-7 left


@pytest.mark.parametrize("engine", ["process", "batched"])
def test_gt_adam_on_a_ring_with_accelerated_exchanges_is_one_model_on_the_union(engine, tmp_path):
    expected = one_model_on_the_union(RING)
    states = process_engine_states(ACCELERATED) if engine == "process" else \
        list(batched_states(ACCELERATED, tmp_path, "on"))
    for state in states:
        assert torch.allclose(state[:len(expected)], expected, rtol=0, atol=1e-5)
    if engine == "batched":  # one exchange an iteration, or sixteen plain ones, leave the ring well apart from it
        for values in (RING, {**RING, "mixing_steps": 16}):
            states = batched_states(values, tmp_path / str(values.get("mixing_steps")), "on")
            assert float((states[:, :len(expected)] - expected).abs().max()) > 1e-2


@pytest.mark.parametrize("algorithm, values", [
    ("qgdsgdm", {"momentum": 0.9, "mixing_steps": 3, "mixing_accelerated": True}),
    ("pushsum", {"mixing_steps": 2})])
def test_the_engines_agree_with_several_exchanges(algorithm, values, tmp_path):
    run = {**BASE, "algorithm": algorithm, "rounds": 1, **values}
    process = torch.stack(process_engine_states(run))
    batched = batched_states(run, tmp_path / "on", "on")
    assert torch.allclose(process, batched, rtol=0, atol=1e-6)
    once = batched_states({**run, "mixing_steps": 1, "mixing_accelerated": False}, tmp_path / "once", "on")
    assert float((once - batched).abs().max()) > 1e-4  # the exchanges changed the models


def test_what_several_exchanges_refuse():
    for values, message in [
        ({"mixing_accelerated": True}, "mixing_accelerated needs mixing_steps 2 or more"),
        ({"mixing_steps": 0}, "mixing_steps 0: Input should be greater than or equal to 1"),
        ({"mixing_steps": 3, "algorithm": "gossip"}, "which algorithm gossip does not make once an iteration"),
        ({"mixing_steps": 3, "algorithm": "fedavg"}, "use one that does \\(dadam, dpsgd, gtadam, pushsum, qgdsgdm"),
        ({"mixing_steps": 3, "sharing": "topk:0.1"}, "use sharing full \\(not topk:0.1\\)"),
        ({"mixing_steps": 3, "mixing_accelerated": True, "transport": "udp"}, "mixing_accelerated needs transport tcp"),
        ({"mixing_steps": 3, "mixing_accelerated": True, "aggregation": "median"}, "needs aggregation mean"),
        ({"mixing_steps": 3, "mixing_accelerated": True, "peer_sampling": "graph"}, "needs a static topology"),
        ({"mixing_steps": 3, "mixing_accelerated": True, "topology": "one-peer-exponential"}, "a static topology")]:
        with pytest.raises(ConfigError, match=message):
            make_config(values)
    make_config({"mixing_steps": 3, "transport": "udp"})  # plain steps: each one's per-chunk sum
    make_config({"mixing_steps": 3, "aggregation": "median"})  # the rule at every step


def test_accelerated_exchanges_refuse_weights_that_are_not_symmetric():
    from helpers.rounds import Fixed

    from meshlearn.definitions.pushsum import PushSum

    class Directed(Fixed, StaticRounds):  # a static round whose weights are not symmetric
        pass

    rounds = Directed([[1], [2], [0]])
    for i, row in enumerate(rounds._round.weights):
        row.update({j: 0.5 for j in row})
    with pytest.raises(ConfigError, match="needs symmetric weights"):
        RepeatedMixing(PushSum(rounds, 3, 0), MixingSettings(steps=2, accelerated=True))
