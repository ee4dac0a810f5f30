"""The exchange features (robust rules, bad nodes, a lossy network) on the batched engine's one
round runner, for every round algorithm whose declaration takes them: FedAvg's server under a
robust rule, push-sum's and gradient tracking's bad nodes forging their payloads, and a user's
algorithm over a lossy network with a robust rule. Every node runs in this process
(``BatchedSimulation``); the models are the digits MLP, for one to three iterations."""

from __future__ import annotations

import pytest
import torch

from meshlearn.aggregation import get_rule
from meshlearn.batched import BatchedSimulation
from meshlearn.batched.algorithms import runtimes
from meshlearn.batched.algorithms.rounds import BatchedRounds
from meshlearn.config import make_config
from meshlearn.definitions import Needs, RoundAlgorithm
from meshlearn.definitions.base import DEFINITIONS
from meshlearn.definitions.fedavg import participants
from meshlearn.definitions.settings import drawn as count_of
from meshlearn.errors import ConfigError
from meshlearn.topology import build_topology

SMALL = {"dataset": "digits", "model": "mlp", "rounds": 1, "batch_size": 16, "lr": 0.05, "test_after": 100,
         "engine": "batched", "step_time": 0.001}
FLIP = 10.0  # sign-flip:10: a bad node sends -10 times its payload
BAD = 1


class Recorded(BatchedRounds):
    """The round runner, recording every exchange's honest payloads (``payloads``: iteration,
    phase, [N, Q]) and the rows its links read (``sources``: [N + bad nodes, Q], the forged ones
    last)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.payloads: list[tuple[int, int, torch.Tensor]] = []
        self.read: list[torch.Tensor] = []
        payload = self.rules.payload

        def recording(own, state, exchange):
            sent = payload(own, state, exchange)
            self.payloads.append((exchange.iteration, exchange.phase, sent.clone()))
            return sent

        self.rules.payload = recording

    def sources(self, *args, **kwargs):
        rows = super().sources(*args, **kwargs)
        self.read.append(rows.clone())
        return rows


@pytest.fixture()
def runners(monkeypatch) -> list[Recorded]:
    """The round runners the batched engine builds in the test, recording (``Recorded``)."""
    made = []

    class Recording(Recorded):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(runtimes, "BatchedRounds", Recording)
    return made


def run(values: dict, tmp_path) -> BatchedSimulation:
    """The batched engine's run of ``values`` (over ``SMALL``), done."""
    config = make_config({**SMALL, **values})
    simulation = BatchedSimulation(config, build_topology(config.topology, config.nodes, config.seed),
                                   tmp_path / f"run{len(list(tmp_path.iterdir()))}")
    simulation.run()
    return simulation


# --- FedAvg's server under a robust rule -------------------------------------------------------------

BAD_CLIENT = 3


def server_out(seed: int, nodes: int, fraction: float) -> bool:
    """Whether the first round of ``seed`` draws the bad client and at least two others, not the server."""
    drawn = participants(seed, 0, nodes, count_of(fraction, nodes))
    return 0 not in drawn and BAD_CLIENT in drawn and len(drawn) >= 3


@pytest.mark.parametrize("fraction", [1.0, 0.6])
def test_fedavgs_server_takes_the_robust_rule_over_the_drawn_clients_where_the_mean_is_dragged_away(
        fraction, runners, tmp_path):
    """One iteration, a bad client sending its model flipped (its payload's trailing 1, which the
    server checks, as it is): the
    server's aggregate under the median is the median of the payloads it pooled (its own only where
    it was drawn), inside the honest clients' range in every coordinate; under the mean the flip
    drags it far away. Every node ends with the server's answer."""
    nodes = 5
    seed = 2 if fraction == 1.0 else next(seed for seed in range(1000) if server_out(seed, nodes, fraction))
    drawn = participants(seed, 0, nodes, count_of(fraction, nodes))
    assert (0 in drawn) == (fraction == 1.0)
    finals = {}
    for rule in ("median", "mean"):
        simulation = run({"algorithm": "fedavg", "nodes": nodes, "topology": "full", "iterations": 1, "seed": seed,
                          "fedavg_fraction": fraction, "aggregation": rule,
                          "byzantine": f"{BAD_CLIENT}:sign-flip:{FLIP:g}"}, tmp_path)
        runner = runners[-1]
        pushed = next(sent for _, phase, sent in runner.payloads if phase == 0)
        forged = runner.read[0][nodes:]
        assert forged.shape[0] == 1 and torch.equal(forged[0, :-1], -FLIP * pushed[BAD_CLIENT, :-1])
        assert float(forged[0, -1]) == 1.0  # the trailing 1 as it is: a payload with another is refused
        final = simulation.stacked.state
        assert all(torch.equal(row, final[0]) for row in final)  # everyone took the server's answer
        honest = torch.stack([pushed[j, :-1] for j in drawn if j != BAD_CLIENT])  # the server's own if drawn
        if rule == "median":
            pooled = torch.stack([pushed[j] if j != BAD_CLIENT else forged[0] for j in drawn])
            expected = get_rule("median")(pooled, [1.0] * len(pooled))
            assert float(expected[-1]) == 1.0  # the payload's trailing 1 comes through the rule
            assert torch.allclose(final[0], expected[:-1], atol=1e-6)
        lo, hi = honest.aminmax(dim=0)
        inside = (final[0] >= lo - 1e-6) & (final[0] <= hi + 1e-6)
        assert bool(inside.all()) if rule == "median" else float(inside.float().mean()) < 0.5
        finals[rule] = final[0].clone()
    assert float((finals["mean"] - finals["median"]).norm()) > float(finals["median"].norm())


def test_a_sign_flipped_fedavg_client_keeps_the_weight_the_server_divides_by(runners, tmp_path):
    """The sign-flipper sends [-10 model, 1]: the 1 the server checks stays, so under the mean its
    flipped model counts with its own samples' weight and drags the average (the weights sum to one)."""
    run({"algorithm": "fedavg", "nodes": 5, "topology": "full", "iterations": 1, "seed": 2,
         "byzantine": f"{BAD_CLIENT}:sign-flip:{FLIP:g}"}, tmp_path)
    runner = runners[-1]
    pushed = next(sent for _, phase, sent in runner.payloads if phase == 0)
    assert torch.allclose(runner.read[0][5, :-1], -FLIP * pushed[BAD_CLIENT, :-1])
    assert float(runner.read[0][5, -1]) == 1.0
    weights = torch.tensor(runner.rules.samples, dtype=torch.float64)
    models = pushed[:, :-1].clone()
    models[BAD_CLIENT] *= -FLIP
    expected = (weights.to(pushed.dtype)[:, None] * models).sum(0) / float(weights.sum())
    assert torch.allclose(runner.ctx.stacked.state[0], expected, atol=1e-5)


def test_fedavgs_server_counts_the_bad_clients_deviant_models_against_it(runners, tmp_path):
    """Three iterations, every client drawn: the server finds the sign-flipper's models deviant
    from its median each time and suspects it (the process engine's report)."""
    run({"algorithm": "fedavg", "nodes": 5, "topology": "full", "iterations": 3, "seed": 2, "aggregation": "median",
         "byzantine": f"{BAD_CLIENT}:sign-flip:{FLIP:g}"}, tmp_path)
    report = runners[-1].peers_report()
    assert set(report) == {0}  # only the server pools
    assert report[0]["suspected"] == [BAD_CLIENT]
    assert {name: report[0]["peers"][str(BAD_CLIENT)][name] for name in ("heard", "refused", "deviant")} == \
        {"heard": 3, "refused": 0, "deviant": 3}


# --- push-sum's and gradient tracking's bad nodes forge their payloads --------------------------------


@pytest.mark.parametrize("algorithm", ["pushsum", "tracking"])
@pytest.mark.parametrize("attack", [f"sign-flip:{FLIP:g}", "stale"])
def test_a_bad_node_sends_what_its_attack_forges_from_its_payload(algorithm, attack, runners, tmp_path):
    """Push-sum's payload is [x, w], tracking's [x + d, d]: a sign-flipper sends -10 times it, a
    stale node its first payload every iteration; the links out of it read that row, the others
    read the honest payloads."""
    nodes = 4
    run({"algorithm": algorithm, "nodes": nodes, "topology": "ring", "iterations": 3, "seed": 5,
         "byzantine": f"{BAD}:{attack}"}, tmp_path)
    runner = runners[-1]
    honest = [sent for _, _, sent in runner.payloads]
    size = runner.ctx.stacked.state.shape[1]
    assert len(honest) == len(runner.read) == 3
    assert all(sent.shape == (nodes, size + 1 if algorithm == "pushsum" else 2 * size) for sent in honest)
    for iteration, (read, sent) in enumerate(zip(runner.read, honest)):
        assert torch.equal(read[:nodes], sent)  # every node's true payload, its own row too
        expected = -FLIP * sent[BAD] if attack.startswith("sign-flip") else honest[0][BAD]
        assert torch.allclose(read[nodes], expected), iteration
    assert not torch.allclose(honest[0][BAD], honest[-1][BAD])  # its honest payload moved on: stale really is stale


def test_a_push_sum_neighbour_merges_the_forged_weight(runners, tmp_path):
    """Ring of four, shares of a third: after one round a neighbour of the sign-flipper holds
    w = 1/3 + 1/3 - 10/3, what the forged [x, w] gives; the node across the ring, w = 1."""
    run({"algorithm": "pushsum", "nodes": 4, "topology": "ring", "iterations": 1, "seed": 5,
         "byzantine": f"{BAD}:sign-flip:{FLIP:g}"}, tmp_path)
    weights = runners[-1].state["w"].tolist()
    for rank in build_topology("ring", 4, 5).neighbours(BAD):
        assert weights[rank] == pytest.approx((2 - FLIP) / 3)
    assert weights[(BAD + 2) % 4] == pytest.approx(1.0)


def test_gradient_trackings_honest_nodes_take_the_forged_payload_in(tmp_path):
    """The same run with and without the sign-flipper (which trains as it would honestly): the
    nodes next to it end elsewhere; so does the node across the ring, a round later."""
    values = {"algorithm": "tracking", "nodes": 4, "topology": "ring", "iterations": 2, "seed": 5}
    clean = run(values, tmp_path).stacked.state.clone()
    attacked = run({**values, "byzantine": f"{BAD}:sign-flip:{FLIP:g}"}, tmp_path).stacked.state
    for rank in range(4):
        assert float((attacked[rank] - clean[rank]).norm()) > 0.1 * float(clean[rank].norm()), rank


# --- a user's algorithm declaring lossy, robust and byzantine ----------------------------------------


class Doubled(RoundAlgorithm):
    """A user's algorithm sending twice its model and taking half of what it mixed: D-PSGD in
    other units, so whatever the runner does with payloads (a robust rule, chunks lost, a forged
    row) must come out as D-PSGD's."""

    name = "doubled-test"
    summary = "D-PSGD sending twice its model: a test's algorithm"
    needs = Needs(lossy=True, robust=True, byzantine=True)

    def payload(self, own, state, exchange):
        return own * 2

    def merge(self, own, state, mixed, exchange):
        own.copy_(mixed).div_(2)


class OwnStackRule(Doubled):
    """A user's algorithm merging a stack by its own rule (no weighted sum a robust rule could replace)."""

    name = "own-stack-test"
    linear = False


@pytest.fixture()
def users_algorithms(monkeypatch):
    for cls in (Doubled, OwnStackRule):
        monkeypatch.setitem(DEFINITIONS._items, cls.name, cls)


@pytest.mark.parametrize("rule", ["median", "mean"])
def test_a_users_algorithm_over_a_lossy_network_with_a_robust_rule_and_a_bad_node_is_dpsgd(
        rule, users_algorithms, runners, tmp_path):
    """Seven nodes of degree four over UDP losing a tenth of their chunks, one sign-flipper: the
    user's algorithm (payload 2x) ends where D-PSGD does, per chunk of what arrived, under the
    median and the mean; chunks really were lost, and the median kept the honest nodes near their
    models after their first steps where the mean did not."""
    values = {"nodes": 7, "topology": "regular:4", "iterations": 3, "seed": 11, "transport": "udp",
              "net": "loss=10%", "udp_timeout": 0.3, "chunk_bytes": 1424, "aggregation": rule,
              "byzantine": f"{BAD}:sign-flip:{FLIP:g}"}
    dpsgd = run({**values, "algorithm": "dpsgd"}, tmp_path).stacked.state.clone()
    users = run({**values, "algorithm": "doubled-test"}, tmp_path).stacked.state
    assert runners[-1].traffic.counters["chunks_lost"].sum() > 0
    assert torch.allclose(users, dpsgd, atol=1e-5)
    start = runners[-1].payloads[0][2] / 2  # every node's model after its first steps
    drift = max(float((users[rank] - start[rank]).norm() / start[rank].norm()) for rank in range(7) if rank != BAD)
    assert drift < 0.1 if rule == "median" else drift > 1.0, drift


@pytest.mark.parametrize("extra,what", [({"aggregation": "median"}, "use aggregation mean"),
                                        ({"transport": "udp"}, "use transport tcp")])
def test_a_robust_rule_or_udp_is_refused_where_the_definition_merges_by_its_own_rule(
        extra, what, users_algorithms, tmp_path):
    with pytest.raises(ConfigError, match=f"own-stack-test with these settings merges by its own rule.*{what}"):
        run({"algorithm": "own-stack-test", "nodes": 3, "topology": "ring", "iterations": 1, **extra}, tmp_path)

