"""What the nodes minimise together (``objective``): with ``samples`` each node's gradients count by
its share of the training samples, so GT-Adam on a complete graph over a split of unequal shards
is one model trained on the nodes' batches with each node's loss so weighted (both engines); the
weights by hand; the settings refused."""

import pytest
import torch
from helpers.engines import batched_states, process_engine_states
from test_adaptive import EXACT, one_model_on_the_union

from meshlearn.config import make_config
from meshlearn.data import partition_dataset
from meshlearn.definitions.objective import sample_weights
from meshlearn.errors import ConfigError
from meshlearn.node.factory import load_run_dataset
from meshlearn.optim import ScaledGradients, make_optimizer

SKEWED = {**EXACT, "partition": "dirichlet:0.3", "objective": "samples"}


def test_the_weights_are_each_nodes_share_of_the_samples_times_the_nodes():
    assert sample_weights([100, 300, 400], [0, 1, 2]) == pytest.approx([0.375, 1.125, 1.5])
    assert sample_weights([100, 300, 400], [2]) == pytest.approx([1.5])  # a block of rows: its own
    assert sample_weights([99, 0], [0, 1]) == [1.98, 0.02]  # an empty shard counts as one sample, as FedAvg's
    params = torch.zeros(3, 2)
    scaled = ScaledGradients(make_optimizer("sgd", params, lr=1.0), torch.tensor([0.5, 1.0, 2.0]))
    scaled.step(torch.ones(3, 2))
    assert params.tolist() == [[-0.5, -0.5], [-1.0, -1.0], [-2.0, -2.0]]
    scaled.set_lr(0.5)
    scaled.step(torch.ones(1, 2), rows=torch.tensor([2]))  # the rows that trained: their own weights
    assert params.tolist() == [[-0.5, -0.5], [-1.0, -1.0], [-3.0, -3.0]]
    assert scaled.params is params  # every other use goes to the optimizer


@pytest.mark.parametrize("engine", ["process", "batched"])
def test_gt_adam_minimising_the_samples_loss_is_one_model_on_the_weighted_union(engine, tmp_path):
    sizes = [len(part) for part in partition_dataset(load_run_dataset(make_config(SKEWED)), 4, SKEWED["partition"],
                                                       SKEWED["seed"])]
    assert max(sizes) > 2 * min(sizes)  # shards unequal enough for the weights to matter
    expected = one_model_on_the_union(SKEWED, by_samples=True)
    alike = one_model_on_the_union(SKEWED)
    assert float((expected - alike).abs().max()) > 1e-2  # the objectives train different models
    states = process_engine_states(SKEWED) if engine == "process" else list(batched_states(SKEWED, tmp_path, "on"))
    for state in states:
        assert torch.allclose(state[:len(expected)], expected, rtol=0, atol=1e-5)


def test_what_the_samples_objective_refuses():
    for values, message in [
        ({"objective": "samples", "algorithm": "fedavg"}, "fedavg's server already weighs clients by their samples"),
        ({"objective": "samples", "algorithm": "gossip"}, "not algorithm gossip's: use objective nodes"),
        ({"objective": "samples", "optimizer": "adamw"}, "use optimizer sgd, or algorithm gtadam"),
        ({"objective": "everyone"}, "objective 'everyone': Input should be 'nodes' or 'samples'")]:
        with pytest.raises(ConfigError, match=message):
            make_config(values)
    make_config({"objective": "samples", "algorithm": "gtadam", "optimizer": "adamw"})
    make_config({"objective": "samples", "algorithm": "qgdsgdm", "momentum": 0.9})
