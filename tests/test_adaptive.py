"""The optimizers over graphs (GT-Adam, Adam with mixed moments, QG-DSGDm): each update rule by
hand, GT-Adam on a complete graph against one model trained on the union of the nodes' batches
(both engines), the engines against each other, and the settings each refuses."""

import pytest
import torch
from helpers.engines import BASE, batched_states, process_engine_states
from helpers.rounds import exchange

from meshlearn.config import make_config
from meshlearn.data import ShardLoader, loader_seed, partition_dataset
from meshlearn.definitions.dadam import MixedMomentsAdam
from meshlearn.definitions.gtadam import GradientTrackingAdam
from meshlearn.definitions.objective import sample_weights
from meshlearn.definitions.qgdsgdm import QuasiGlobalMomentum, QuasiGlobalSettings
from meshlearn.errors import ConfigError
from meshlearn.models import build_model
from meshlearn.node.factory import load_run_dataset
from meshlearn.optim import GradientInbox, make_optimizer
from meshlearn.topology import build_topology
from meshlearn.topology.sampling import StaticRounds

HALVES = StaticRounds(build_topology("full", 2, 0))  # two nodes, weights 1/2: W = [[.5, .5], [.5, .5]]


def test_gt_adam_steps_along_the_mixed_tracker_by_hand():
    own = torch.tensor([[0.0], [0.0]])
    sgd = make_optimizer("sgd", own, lr=1.0)  # the rows' optimizer: x <- x - direction, to follow by hand
    rule = GradientTrackingAdam(HALVES, 2, 0)
    state = rule.begin(own)
    local = rule.local_optimizer(sgd, state)
    assert isinstance(local, GradientInbox)
    # iteration 0: gradients g0 = (1, 3) only recorded; y0 = g0; x1 = W x0 - W y0 = (-2, -2)
    local.step(torch.tensor([[1.0], [3.0]]))
    assert own.flatten().tolist() == [0.0, 0.0]  # the local step moves nothing
    exchange(rule, own, state, 0)
    assert own.flatten().tolist() == [-2.0, -2.0]
    # iteration 1: g1 = (-1, 5); y1 = W y0 + g1 - g0 = (0, 4); x2 = W x1 - W y1 = (-4, -4)
    local.step(torch.tensor([[-1.0], [5.0]]))
    exchange(rule, own, state, 1)
    assert own.flatten().tolist() == [-4.0, -4.0]
    assert state["mixed"].flatten().tolist() == [2.0, 2.0]  # W y1: the average of the latest gradients
    with pytest.raises(ConfigError, match="every node trains every iteration"):
        local.step(torch.ones(1, 1), rows=torch.tensor([0]))


def test_gt_adam_tracks_the_average_gradient_on_a_ring_as_the_matrix_form_says():
    """On a ring of four (weights 1/3: not a complete graph, where the tracker would not matter), the
    models and trackers follow ``x <- W x - lr W y``, ``y <- W y + g_new - g_old``, written here with W."""
    torch.manual_seed(0)
    ring = StaticRounds(build_topology("ring", 4, 0))
    W = torch.zeros(4, 4, dtype=torch.float64)
    for i in range(4):
        W[i, i] = 1 / 3
        for j in ring.round(0).receive_from[i]:
            W[i, j] = ring.round(0).weights[i][j]
    assert torch.allclose(W.sum(0), torch.ones(4, dtype=torch.float64)) and W[0, 2] == 0
    own = torch.randn(4, 3, dtype=torch.float64)
    x, y, last = own.clone(), None, torch.zeros(4, 3, dtype=torch.float64)
    rule = GradientTrackingAdam(ring, 4, 0)
    state = rule.begin(own)
    local = rule.local_optimizer(make_optimizer("sgd", own, lr=0.1), state)
    for iteration in range(4):
        gradients = torch.randn(4, 3, dtype=torch.float64)
        local.step(gradients)
        y = gradients if y is None else W @ y + gradients - last
        last = gradients
        x = W @ x - 0.1 * (W @ y)
        exchange(rule, own, state, iteration)
        assert torch.allclose(own, x) and torch.allclose(state["mixed"], W @ y)
        assert torch.allclose(state["mixed"].mean(0), gradients.mean(0))  # the tracked average is the gradients'
        assert not torch.allclose(state["mixed"][0], state["mixed"][2])  # and the nodes' trackers differ


def test_adam_with_mixed_moments_averages_the_moments_by_hand():
    own = torch.tensor([[0.0], [0.0]])
    adam = make_optimizer("adam:betas=0.5 0.75,eps=0", own, lr=0.1)
    rule = MixedMomentsAdam(HALVES, 2, 0)
    state = rule.begin(own)
    assert rule.local_optimizer(adam, state) is adam  # the local steps are the run's Adam
    adam.step(torch.tensor([[2.0], [4.0]]))  # each node alone: m = g / 2, v = g^2 / 4, step lr * sign(g)
    assert own.flatten().tolist() == pytest.approx([-0.1, -0.1])
    exchange(rule, own, state, 0)
    moments = adam.rows_state()
    assert moments["exp_avg"].flatten().tolist() == pytest.approx([1.5, 1.5])  # (1 + 2) / 2
    assert moments["exp_avg_sq"].flatten().tolist() == pytest.approx([2.5, 2.5])  # (1 + 4) / 2
    # the next step from the mixed moments: m = (0.75 + 0, 0.75 + 1), v = (1.875 + 0, 1.875 + 1)
    adam.step(torch.tensor([[0.0], [2.0]]))
    m = torch.tensor([0.75, 1.75]) / (1 - 0.5 ** 2)
    v = torch.tensor([1.875, 2.875]) / (1 - 0.75 ** 2)
    assert own.flatten().tolist() == pytest.approx((-0.1 - 0.1 * m / v.sqrt()).tolist())


def test_quasi_global_momentum_follows_the_move_after_averaging_by_hand():
    own = torch.tensor([[0.0], [4.0]])
    sgd = make_optimizer("sgd", own, lr=0.5, momentum=0.5)
    rule = QuasiGlobalMomentum(HALVES, 2, 0, QuasiGlobalSettings(mu=0.25))
    state = rule.begin(own)
    local = rule.local_optimizer(sgd, state)
    assert local is sgd
    # iteration 0: m̂ = 0; g = (2, 2): x½ = x - 0.5 (0.5 * 0 + g) = (-1, 3); x1 = (1, 1)
    rule.start_round(own, state, 0)
    local.step(torch.tensor([[2.0], [2.0]]))
    exchange(rule, own, state, 0)
    assert own.flatten().tolist() == [1.0, 1.0]
    # d = (x0 - x1) / 0.5 = (-2, 6); m̂ = 0.25 * 0 + 0.75 d = (-1.5, 4.5)
    assert state["buffer"].flatten().tolist() == [-1.5, 4.5]
    # iteration 1: g = (1, 1); m = 0.5 m̂ + g = (0.25, 3.25); x½ = (0.875, -0.625); x2 = (0.125, 0.125)
    rule.start_round(own, state, 1)
    local.step(torch.tensor([[1.0], [1.0]]))
    assert own.flatten().tolist() == [0.875, -0.625]
    exchange(rule, own, state, 1)
    assert own.flatten().tolist() == [0.125, 0.125]
    # d = (1 - 0.125) / 0.5 = 1.75 each; m̂ = 0.25 m̂ + 0.75 d = (0.9375, 2.4375)
    assert state["buffer"].flatten().tolist() == [0.9375, 2.4375]


EXACT = {**BASE, "nodes": 4, "topology": "full", "algorithm": "gtadam", "optimizer": "adamw", "lr": 0.005,
         "weight_decay": 0.01, "rounds": 1, "iterations": 12, "batch_size": 16}


def one_model_on_the_union(values: dict, by_samples: bool = False) -> torch.Tensor:
    """One model trained with torch.optim.AdamW on the union of the nodes' batches of every step
    (each node's batches as its loader draws them), from the nodes' first model: its parameters.
    Its loss is the mean over the nodes of each one's batch loss, each times its ``sample_weights``
    where ``by_samples`` (the ``objective samples`` a run minimises), else alike."""
    config = make_config(values)
    dataset = load_run_dataset(config)
    parts = partition_dataset(dataset, config.nodes, config.partition, config.seed)
    weights = sample_weights([len(part) for part in parts], range(config.nodes)) if by_samples else \
        [1.0] * config.nodes
    loaders = [ShardLoader(dataset, parts[rank], config.batch_size, loader_seed(config.seed, rank))
               for rank in range(config.nodes)]
    torch.manual_seed(config.seed)
    model = build_model(config.model, dataset.input_shape, dataset.num_classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    for _ in range(config.iterations):
        optimizer.zero_grad()
        loss = sum(weight * torch.nn.functional.cross_entropy(model(x), y)
                   for weight, (x, y) in zip(weights, [loader.next_batch() for loader in loaders]))
        (loss / config.nodes).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("engine", ["process", "batched"])
def test_gt_adam_on_a_complete_graph_is_one_model_on_the_union_of_the_batches(engine, tmp_path):
    expected = one_model_on_the_union(EXACT)
    states = process_engine_states(EXACT) if engine == "process" else list(batched_states(EXACT, tmp_path, "on"))
    first = one_model_on_the_union({**EXACT, "iterations": 1})
    assert float((expected - first).abs().max()) > 1e-2  # the run moved the model well beyond the tolerance
    for state in states:
        assert torch.allclose(state[:len(expected)], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("algorithm, values", [
    ("gtadam", {"optimizer": "adamw", "lr": 0.01}),
    ("dadam", {"optimizer": "adamw", "lr": 0.01}),
    ("qgdsgdm", {"momentum": 0.9, "weight_decay": 1e-3, "lr_schedule": "cosine:min=0"})])  # the last rate is 0
def test_the_engines_agree_on_each_optimizer_over_the_graph(algorithm, values, tmp_path):
    run = {**BASE, "algorithm": algorithm, "rounds": 1, **values}
    process = torch.stack(process_engine_states(run))
    for vectorize in ("on", "off"):
        batched = batched_states(run, tmp_path / vectorize, vectorize)
        assert torch.allclose(process, batched, rtol=0, atol=1e-6)
    assert float((batched - batched.mean(0)).abs().max()) > 1e-4  # a 3-regular graph: the nodes still differ
    plain = batched_states({**run, "algorithm": "dpsgd"}, tmp_path / "dpsgd", "on")  # the same optimizer, its own
    assert float((plain - batched).abs().max()) > 1e-3  # steps: the algorithm changed what the optimizer did


def test_each_refuses_what_its_update_rule_cannot_take():
    for values, message in [
        ({"algorithm": "gtadam", "rounds": 2}, "algorithm gtadam takes one local step per iteration"),
        ({"algorithm": "gtadam", "full_epochs": True}, "set rounds 1 \\(and not full_epochs\\)"),
        ({"algorithm": "gtadam", "transport": "udp"}, "needs transport tcp \\(the tracker follows"),
        ({"algorithm": "gtadam", "aggregation": "median"}, "needs aggregation mean \\(the tracker follows"),
        ({"algorithm": "dadam"}, "optimizer sgd keeps none: use optimizer adamw"),
        ({"algorithm": "dadam", "optimizer": "adam", "transport": "udp"}, "a lost chunk of a moment"),
        ({"algorithm": "qgdsgdm"}, "use optimizer sgd with momentum"),
        ({"algorithm": "qgdsgdm", "optimizer": "adam", "momentum": 0.9}, "use optimizer sgd with momentum"),
        ({"algorithm": "qgdsgdm", "momentum": 0.9, "rounds": 3}, "algorithm qgdsgdm takes one local step"),
        ({"algorithm": "qgdsgdm", "momentum": 0.9, "qgdsgdm_mu": 1.0}, "qgdsgdm_mu"),
        # trackers follow the average only under doubly stochastic weights; a forged moment can be negative
        ({"algorithm": "gtadam", "peer_sampling": "epidemic:2"}, "gtadam needs doubly stochastic weights"),
        ({"algorithm": "tracking", "peer_sampling": "epidemic:1"}, "use peer_sampling graph, or algorithm pushsum"),
        ({"algorithm": "dadam", "optimizer": "adam", "byzantine": "0:sign-flip"}, "a forged second moment")]:
        with pytest.raises(ConfigError, match=message):
            make_config(values)
    make_config({"algorithm": "qgdsgdm", "momentum": 0.9, "transport": "udp", "aggregation": "median"})
    make_config({"algorithm": "dadam", "momentum": 0.9})  # SGD's momentum buffer is mixed
    make_config({"algorithm": "gtadam", "optimizer": "adamw", "peer_sampling": "graph"})  # Metropolis-Hastings
