"""Robust aggregation: each rule by hand, their invariances, the attacks, and runs under attack."""

import itertools
import json

import pytest
import torch
from helpers.engines import metropolis_average

from meshlearn.aggregation import aggregate_present, get_rule, parse_rule
from meshlearn.aggregation.suspects import PeerWatch, refusal
from meshlearn.attacks.forge import ForgeInputs, make_attack
from meshlearn.attacks.spec import parse_byzantine
from meshlearn.batched.mixing import Links
from meshlearn.config import make_config
from meshlearn.definitions.averaging import weighted_average_
from meshlearn.errors import ConfigError
from meshlearn.node import build_node
from meshlearn.sim import simulate
from meshlearn.sim.checks import check_before_start
from meshlearn.sim.inprocess import run_threads
from meshlearn.sim.summary import format_summary
from meshlearn.topology import build_topology

RULES = ["mean", "median", "trimmed-mean:2", "krum:1", "multi-krum:1:3", "clip", "clip:0.5", "clip:nearest", "filter",
         "filter:1.5"]


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# --- each rule on hand-computed vectors --------------------------------------------------------------


def test_mean_median_and_trimmed_mean_by_hand():
    models = _t([[1, 2], [3, 6], [5, -4], [100, 0]])
    assert torch.allclose(get_rule("mean")(models, [1, 1, 2, 0]), _t([14 / 4, 0]))
    assert torch.allclose(get_rule("median")(models[:3], [1, 1, 1]), _t([3, 2]))
    assert torch.allclose(get_rule("median")(models, [1, 1, 1, 1]), _t([4, 1]))  # even: the two middle ones
    assert torch.allclose(get_rule("trimmed-mean:1")(models, [1, 1, 1, 1]), _t([4, 1]))
    five = torch.cat([models, _t([[-50, 7]])])
    assert torch.allclose(get_rule("trimmed-mean:1")(five, [1] * 5), _t([3, 8 / 3]))
    # too few models for B: it trims (K - 1) // 2 from each side
    assert torch.allclose(get_rule("trimmed-mean:3")(models[:3], [1, 1, 1]), _t([3, 2]))


def test_krum_and_multi_krum_by_hand():
    models = _t([[0, 0], [1, 0], [0, 1], [10, 10]])
    # f = 1, K = 4: each model's distance to its 1 nearest other; 0, 1 and 2 tie at 1, 3 is at 181
    assert torch.equal(get_rule("krum:1")(models, [1] * 4), _t([0, 0]))  # ties go to the own model
    assert torch.allclose(get_rule("multi-krum:1:3")(models, [1] * 4), _t([1 / 3, 1 / 3]))
    far = _t([[10, 10], [0, 0], [1, 0], [0, 1]])  # a bad own model is not chosen either
    assert torch.equal(get_rule("krum:1")(far, [1] * 4), _t([0, 0]))


def test_self_centred_clipping_by_hand():
    models = _t([[0, 0], [3, 4], [0.3, 0.4]])
    # tau 1: the far neighbour's difference (length 5) is cut to length 1, the near one kept
    assert torch.allclose(get_rule("clip:1")(models, [1, 1, 1]), _t([0.3, 0.4]))
    # no tau: the median of the neighbours' distances (5 and 0.5: 2.75)
    assert torch.allclose(get_rule("clip")(models, [1, 1, 1]), _t([(1.65 + 0.3) / 3, (2.2 + 0.4) / 3]))
    assert torch.allclose(get_rule("clip:100")(models, [2, 1, 1]), get_rule("mean")(models, [2, 1, 1]))
    assert torch.equal(get_rule("clip")(models[:1], [1]), models[0])  # alone: its own model


def test_clipping_to_the_nearest_neighbour_holds_against_a_bad_majority():
    # own model at 0; one honest neighbour at distance 1, two bad ones at 5 and 50
    models = _t([[0, 0], [3, 4], [0.6, 0.8], [30, 40]])
    # radius 1 (the nearest): every difference is cut to (0.6, 0.8), each weighing a quarter
    assert torch.allclose(get_rule("clip:nearest")(models, [1] * 4), _t([0.45, 0.6]))
    # the median radius (5) lets the bad majority through: it is moved 5 times further
    assert torch.allclose(get_rule("clip")(models, [1] * 4), _t([0.25 * (3 + 0.6 + 3), 0.25 * (4 + 0.8 + 4)]))
    assert str(get_rule("clip:nearest")) == "clip:nearest"


def test_distance_filtering_leaves_out_a_far_bad_majority_by_hand():
    # own model at 0; one honest neighbour at distance 1, one at 2.5, two bad ones at 5 and 50
    models = _t([[0, 0], [3, 4], [0.6, 0.8], [30, 40], [1.5, 2]])
    # C 3: within 3 of the nearest (1) are the neighbours at 1 and 2.5; the bad ones' fifths stay with the node
    assert torch.allclose(get_rule("filter")(models, [1] * 5), _t([(0.6 + 1.5) / 5, (0.8 + 2) / 5]))
    assert torch.allclose(get_rule("filter:2")(models, [1] * 5), _t([0.6 / 5, 0.8 / 5]))  # 2.5 is beyond 2
    assert torch.allclose(get_rule("filter:100")(models, [2, 1, 1, 1, 1]), get_rule("mean")(models, [2, 1, 1, 1, 1]))
    assert torch.equal(get_rule("filter")(models[:1], [1]), models[0])  # alone: its own model
    infinite = torch.cat([models[:3], _t([[float("inf"), 0]])])
    assert torch.allclose(get_rule("filter")(infinite, [1] * 4), _t([0.6 / 4, 0.8 / 4]))
    assert str(get_rule("filter")) == "filter:3" and str(get_rule("filter:1.5")) == "filter:1.5"


def test_a_gossiping_node_moves_under_a_robust_rule_only_once_it_has_two_peers_models_to_compare():
    from meshlearn.aggregation.suspects import PeerWatch
    from meshlearn.definitions.gossipstate import robust_target

    own, bad, honest = _t([0, 0]), _t([-30, -40]), _t([0.6, 0.8])
    rule, watch = get_rule("filter"), PeerWatch()
    # the bad peer pulled first: with one model to compare, it would count as much as the node itself
    assert torch.equal(robust_target(rule, own, {1: bad}, 1, watch, neighbours=3), own)
    # then an honest one: the far model is left out, its third stays with the node
    assert torch.allclose(robust_target(rule, own, {1: bad, 2: honest}, 2, watch, neighbours=3), honest / 3)
    # a node with a single neighbour has nothing else to compare: it takes that one, as before
    assert torch.allclose(robust_target(rule, own, {1: honest}, 1, watch, neighbours=1), honest / 2)


@pytest.mark.parametrize("name", RULES)
def test_rules_are_invariant_to_the_order_of_the_neighbours_and_work_in_batches(name):
    rule = get_rule(name)
    generator = torch.Generator().manual_seed(7)
    models = torch.randn(7, 50, generator=generator)
    weights = torch.rand(7, generator=generator, dtype=torch.float64) + 0.1
    expected = rule(models, weights)
    for order in ([0, 3, 1, 6, 2, 5, 4], [0, 6, 5, 4, 3, 2, 1]):  # the own model stays first
        assert torch.allclose(rule(models[order], weights[order]), expected, atol=1e-6)
    batch = torch.stack([models, models[[0, 2, 1, 3, 4, 5, 6]] * 2])
    out = rule(batch, torch.stack([weights, weights[[0, 2, 1, 3, 4, 5, 6]]]))
    assert torch.allclose(out[0], expected, atol=1e-6) and torch.allclose(out[1], rule(models * 2, weights), atol=1e-5)
    assert torch.equal(models, torch.randn(7, 50, generator=torch.Generator().manual_seed(7)))  # inputs untouched


def test_mean_is_dpsgds_metropolis_hastings_average():
    graph = build_topology("regular:3", 8, seed=1)
    generator = torch.Generator().manual_seed(2)
    state = torch.randn(8, 300, generator=generator)
    links = Links.of(graph)
    mixed = metropolis_average(links, state)
    mean = get_rule("mean")
    for i in range(8):
        senders = links.sender[links.receiver == i]
        weights = links.weight[links.receiver == i]
        own = 1 - float(weights.sum())
        rule = mean(torch.cat([state[i:i + 1], state[senders]]), torch.cat([torch.tensor([own]), weights]))
        by_hand = state[i].clone()
        weighted_average_(by_hand, own, [(float(w), state[j]) for w, j in zip(weights, senders)])
        assert torch.allclose(rule, by_hand, atol=1e-6) and torch.allclose(rule, mixed[i], atol=1e-6)


@pytest.mark.parametrize("name", ["mean", "median", "trimmed-mean:1", "clip"])
def test_per_chunk_aggregation_is_the_rule_over_the_chunks_that_arrived(name):
    rule = get_rule(name)
    generator = torch.Generator().manual_seed(3)
    models = torch.randn(3, 5, 10, generator=generator)  # 3 nodes, 5 models each, 10 values in 4 chunks of 3
    weights = torch.rand(3, 5, generator=generator, dtype=torch.float64) + 0.1
    present = torch.rand(3, 5, 4, generator=generator) < 0.6
    out = aggregate_present(rule, models, weights, present, chunk_elements=3)
    for b, c in itertools.product(range(3), range(4)):
        rows = [0] + [k for k in range(1, 5) if present[b, k, c]]
        part = slice(3 * c, min(10, 3 * c + 3))
        assert torch.allclose(out[b, part], rule(models[b, rows, part], weights[b, rows]), atol=1e-6), (b, c)


def test_refusal_and_suspicion():
    model = torch.ones(10)
    assert refusal(model) is None
    model[7] = float("nan")
    assert "NaN" in refusal(model)
    present = torch.tensor([True, True, False, True])  # chunks of 3: the NaN is in chunk 2, which was lost
    assert refusal(model, present, 3) is None
    watch = PeerWatch()
    for _ in range(3):
        watch.refused(4, "its model holds NaN or Inf values")
        watch.heard(2)
    models = torch.stack([torch.zeros(4), torch.ones(4) * 0.1, torch.ones(4) * 0.1, torch.ones(4) * 50])
    for _ in range(3):
        watch.observe([1, 2, 3], models, get_rule("median")(models, [1] * 4))
    assert watch.suspects() == [3, 4]
    assert watch.report()["peers"]["4"]["refused"] == 3 and "2" not in watch.report()["peers"]


# --- names and attacks ---------------------------------------------------------------------------


@pytest.mark.parametrize("text,message", [
    ("trimmed-mean", "write it trimmed-mean:B"), ("krum:x", "whole numbers"), ("clip:0", "positive"),
    ("clip:far", "clip:nearest"), ("clip:nan", "positive numbers"), ("clip:inf", "positive numbers"),
    ("filter:0.5", "at least 1"),
    ("multi-krum:1:0", "positive"), ("median:2", "write it median"),
])
def test_a_badly_written_rule_is_one_clear_error(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_rule(text)
    with pytest.raises(ConfigError, match=message):
        make_config({"aggregation": text})
    with pytest.raises(ConfigError, match="unknown aggregation rule 'average'"):
        check_before_start(make_config({"aggregation": "average"}))  # once a user's module could register it


@pytest.mark.parametrize("text,message", [
    ("3:explode", "BEHAVIOUR one of"), ("9:stale", "node 9 does not exist"), ("3:stale:1", "takes no argument"),
    ("3:sign-flip:x", "SCALE must be a number"), ("3:stale,3:alie", "named twice"), ("x:stale", "RANK:BEHAVIOUR"),
])
def test_a_badly_written_attack_is_one_clear_error(text, message):
    with pytest.raises(ConfigError, match=message):
        make_config({"nodes": 8, "byzantine": text})


def test_what_each_attack_sends():
    own, first = _t([1, -2, 3]), _t([0, 0, 1])
    neighbours = _t([[1, 0, 3], [3, 2, 3]])
    inputs = ForgeInputs(first, neighbours, torch.Generator().manual_seed(0))
    bad = parse_byzantine("0:sign-flip:10,1:scale:3,2:stale,3:label-flip,4:alie:1,5:gaussian:2")
    sent = {rank: make_attack(spec).forge(own, inputs) for rank, spec in bad.items()}
    assert torch.equal(sent[0], _t([-10, 20, -30])) and torch.equal(sent[1], _t([3, -6, 9]))
    assert torch.equal(sent[2], first) and torch.equal(sent[3], own)
    seen = torch.stack([own, *neighbours])  # ALIE: mean - Z std of the models it sees
    assert torch.allclose(sent[4], seen.mean(0) - seen.std(0, unbiased=False))
    assert sent[5].std() > 0.5 and not torch.allclose(sent[5], own)
    assert torch.equal(own, _t([1, -2, 3]))  # the bad node's own model is untouched
    assert make_attack(bad[3]).flips_labels and make_attack(bad[4]).rushing


# --- runs under attack ---------------------------------------------------------------------------------

ATTACKED = {"engine": "batched", "nodes": 8, "topology": "regular:3", "dataset": "digits", "model": "mlp",
            "iterations": 100, "lr": 0.1, "test_after": 100, "seed": 1, "step_time": 0.001,
            "byzantine": "3:sign-flip:10"}


def test_one_sign_flipping_node_wrecks_the_mean_but_not_clipping_or_the_trimmed_mean(tmp_path):
    summaries = {}
    for rule in ("mean", "clip", "trimmed-mean:1"):
        config = make_config({**ATTACKED, "aggregation": rule, "output": str(tmp_path / rule)})
        simulate(config, progress=False)
        summaries[rule] = json.loads((tmp_path / rule / "summary.json").read_text())
    assert summaries["mean"]["final"]["accuracy"] < 0.5
    for rule in ("clip", "trimmed-mean:1"):
        summary = summaries[rule]
        assert summary["final"]["accuracy"] >= 0.85, rule
        assert summary["nodes_evaluated"] == 7 and summary["attackers"] == {"3": "sign-flip:10"}
        neighbours = build_topology("regular:3", 8, seed=1).neighbours(3)
        assert summary["suspected"] == {"3": len(neighbours)}  # every neighbour of the bad node, no one else


def test_under_the_mean_the_summary_names_no_suspects_but_says_whose_models_were_refused_and_why(tmp_path):
    """Under the mean a sign-flipper's model spreads to every node, whose models then turn to NaN and
    are refused by their neighbours: those honest nodes must not be reported as suspects (issue 33)."""
    config = make_config({"nodes": 8, "topology": "regular:3", "dataset": "digits", "model": "mlp", "iterations": 30,
                          "test_after": 30, "seed": 90, "byzantine": "3:sign-flip:10", "output": str(tmp_path)})
    simulate(config, progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "suspected" not in summary and set(summary["refused_from"]) - {"3"}  # honest nodes among them
    text = format_summary(summary)
    assert "suspected" not in text and "models refused from" in text
    assert "honest nodes are among these: a robust --aggregation names the attacker" in text


def test_distance_filtering_holds_where_two_of_a_nodes_three_neighbours_flip_signs(tmp_path):
    # 16 nodes on seed 3's 3-regular graph: node 10's neighbours are 2, 3 and 11, and 3 and 11 are bad
    config = make_config({**ATTACKED, "nodes": 16, "seed": 3, "rounds": 5, "byzantine": "3:sign-flip:10,11:sign-flip:10",
                          "aggregation": "filter", "output": str(tmp_path)})
    assert build_topology("regular:3", 16, seed=3).neighbours(10) == [2, 3, 11]
    simulate(config, progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final"]["accuracy"] >= 0.9 and summary["nodes_evaluated"] == 14
    assert summary["per_node"]["10"]["metrics"]["accuracy"] >= 0.85  # the node the bad majority surrounds


def test_a_model_with_nan_is_refused_counted_and_its_sender_suspected():
    config = make_config({"nodes": 4, "topology": "ring", "dataset": "digits", "model": "mlp", "iterations": 4,
                          "test_after": 100, "seed": 2, "byzantine": "1:scale:1e39", "aggregation": "median"})
    graph = build_topology(config.topology, config.nodes, config.seed)
    nodes = [build_node(config, rank, graph) for rank in range(config.nodes)]
    run_threads(nodes, timeout=120)
    for rank in graph.neighbours(1):
        report = nodes[rank].algorithm.peers_report()
        assert report["suspected"] == [1] and report["peers"]["1"]["refused"] == 4
        assert "NaN or Inf" in report["peers"]["1"]["last_reason"]
        assert bool(torch.isfinite(nodes[rank].flat.state).all())


def test_a_huge_or_infinite_outlier_never_leaks_into_a_robust_rule():
    models = _t([[0.1, 1.0], [1e30, float("inf")], [0.2, 2.0], [0.3, 3.0], [-1e30, 2.0]])
    assert torch.allclose(get_rule("trimmed-mean:1")(models, [1] * 5), _t([0.2, 7 / 3]))
    assert torch.allclose(get_rule("median")(models, [1] * 5), _t([0.2, 2.0]))
    clipped = get_rule("clip")(models[:4], [1] * 4)  # one bad neighbour of three: its row weighs nothing
    assert bool(torch.isfinite(clipped).all()) and float(clipped.abs().max()) < 10
    assert torch.equal(get_rule("trimmed-mean:1")(torch.ones(4, 3), [1] * 4), torch.ones(3))  # ties: two dropped
