"""Training options: any elementwise torch.optim optimizer by name, full epochs, a validation split."""

import pytest
import torch

from meshlearn.config import make_config
from meshlearn.errors import ConfigError
from meshlearn.optim import make_optimizer, parse_optimizer
from meshlearn.sgd import StackedSGD


def test_an_optimizer_is_named_with_its_arguments():
    assert parse_optimizer("adam:betas=0.9 0.99,eps=1e-7,amsgrad=true") == (
        "Adam", {"betas": (0.9, 0.99), "eps": 1e-7, "amsgrad": True})
    assert parse_optimizer("RMSprop:alpha=0.9") == ("RMSprop", {"alpha": 0.9})


@pytest.mark.parametrize("text,message", [
    ("lbfgs", "unknown optimizer 'lbfgs'"), ("adam:lr=0.1", "lr comes from the run's own setting"),
    ("adam:eps", "is not KEY=VALUE"), ("adam:eps=small", "is not a number"),
])
def test_a_bad_optimizer_is_one_clear_error(text, message):
    with pytest.raises(ConfigError, match=message):
        make_config({"optimizer": text})


@pytest.mark.parametrize("values", [{"optimizer": "adam:foo=1"}, {"optimizer": "adam", "momentum": 0.9}])
def test_an_optimizer_torch_refuses_stops_the_run_before_any_node_starts(tmp_path, values):
    from meshlearn.sim.launcher import prepare_run

    with pytest.raises(ConfigError, match="torch.optim.Adam says"):
        prepare_run(make_config({**values, "output": str(tmp_path / "run")}))
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing was written, no node started


def test_an_argument_torch_refuses_is_one_clear_error():
    with pytest.raises(ConfigError, match="torch.optim.Adam says"):
        make_optimizer("adam:betas=2 0.9", torch.zeros(1, 4), lr=0.1)


@pytest.mark.parametrize("spec", ["adam", "adamw:weight_decay=0.01", "rmsprop:alpha=0.9", "adagrad", "nadam"])
def test_each_row_follows_the_optimizer_of_one_node_alone(spec):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 5, generator=generator)
    grads = [torch.randn(3, 5, generator=generator) for _ in range(4)]
    stacked = rows.clone()
    optimizer = make_optimizer(spec, stacked, lr=0.01)
    for g in grads:
        optimizer.step(g.clone())
    for i in range(3):  # node i alone, with torch's own optimizer on its own parameter
        alone = torch.nn.Parameter(rows[i].clone())
        name, args = parse_optimizer(spec)
        reference = getattr(torch.optim, name)([alone], lr=0.01, **args)
        for g in grads:
            alone.grad = g[i].clone()
            reference.step()
        assert torch.allclose(stacked[i], alone.detach(), atol=1e-6), (spec, i)


def test_plain_sgd_stays_meshlearns_own():
    assert isinstance(make_optimizer("sgd", torch.zeros(1, 3), lr=0.1, momentum=0.9), StackedSGD)


def test_full_epochs_make_a_round_one_pass_over_each_nodes_shard(tmp_path):
    from meshlearn.node import build_node
    from meshlearn.sim.inprocess import run_threads
    from meshlearn.topology import build_topology

    config = make_config({"nodes": 2, "topology": "ring", "iterations": 2, "rounds": 1, "full_epochs": True,
                          "batch_size": 100, "dataset": "digits", "test_after": 100, "optimizer": "adam", "lr": 0.001})
    graph = build_topology(config.topology, config.nodes, config.seed)
    nodes = [build_node(config, rank, graph) for rank in range(2)]
    run_threads(nodes, timeout=120)
    for node in nodes:  # 718 or 719 samples: 8 batches of at most 100, twice over
        assert node.steps == 8 and node.loader.samples_seen == 2 * len(node.loader.indices)


def test_full_epochs_on_the_batched_engine_need_shards_of_as_many_batches(tmp_path):
    from meshlearn.batched import BatchedSimulation
    from meshlearn.topology import build_topology

    config = make_config({"engine": "batched", "nodes": 8, "batch_size": 179, "full_epochs": True, "dataset": "digits",
                          "step_time": 0.001})  # 179 or 180 samples: 1 or 2 batches
    with pytest.raises(ConfigError, match="these make 1 to 2: use the process engine"):
        BatchedSimulation(config, build_topology(config.topology, 8, config.seed), tmp_path).run()


def test_a_validation_split_is_seeded_disjoint_and_the_same_everywhere():
    from meshlearn.data import load_digits, split_validation

    data = load_digits()
    test, validation = split_validation(data, 0.25, seed=3)
    again, _ = split_validation(data, 0.25, seed=3)
    assert len(validation.test_y) == round(0.25 * len(data.test_y)) and torch.equal(again.test_x, test.test_x)
    rows = {tuple(x.flatten().tolist()) for x in torch.cat([test.test_x, validation.test_x])}
    assert len(test.test_y) + len(validation.test_y) == len(data.test_y) == len(rows)  # disjoint, nothing lost
    assert torch.equal(test.train_x, data.train_x)  # training data untouched
    assert split_validation(data, 0, seed=3) == (data, None)


def test_both_engines_report_the_same_validation_and_training_shard_accuracy(tmp_path):
    import json

    from meshlearn.sim import simulate

    summaries = {}
    for engine in ("process", "batched"):
        config = make_config({"engine": engine, "nodes": 3, "topology": "ring", "dataset": "digits", "iterations": 10,
                              "test_after": 5, "validation": 0.5, "train_evaluate": True, "step_time": 0.001,
                              "output": str(tmp_path / engine)})
        simulate(config, progress=False)
        summaries[engine] = (tmp_path / engine / "summary.csv").read_text().splitlines()
        assert json.loads((tmp_path / engine / "summary.json").read_text())["final"]["accuracy"] > 0
    header = summaries["process"][0].split(",")
    assert {"val_acc_mean", "val_loss_mean", "shard_acc_mean", "shard_loss_mean"} <= set(header)
    for engine in summaries:
        rows = [dict(zip(summaries[engine][0].split(","), line.split(","))) for line in summaries[engine][1:]]
        summaries[engine] = [(r["iteration"], round(float(r["val_acc_mean"]), 6), round(float(r["shard_acc_mean"]), 6),
                              round(float(r["shard_loss_mean"]), 5)) for r in rows]
    assert summaries["process"] == summaries["batched"] and len(summaries["process"]) == 2


def test_a_learning_rate_schedule_warms_up_then_decays_along_a_cosine():
    from meshlearn.schedule import LrSchedule

    cosine = LrSchedule.model_validate("cosine:warmup=4,min=0.1")
    factors = [cosine.factor(i, 15) for i in range(15)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[-1] == pytest.approx(0.1)
    assert factors[4] == 1.0 and factors[9] == pytest.approx(0.55)  # halfway down: (1 + 0.1) / 2
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))
    assert LrSchedule.model_validate("constant").constant and not LrSchedule.model_validate("constant:warmup=2").constant
    assert make_config({"lr_schedule": "cosine:warmup=4"}).lr_schedule.model_dump() == "cosine:warmup=4,min=0.1"


@pytest.mark.parametrize("text,message", [
    ("linear", "write constant or cosine"), ("cosine:warmup=1.5", "warmup must be a whole number"),
    ("constant:min=0.5", "is not warmup=N"), ("cosine:min=2", "less than or equal to 1"),
])
def test_a_bad_schedule_is_one_clear_error(text, message):
    with pytest.raises(ConfigError, match=message):
        make_config({"lr_schedule": text})
    with pytest.raises(ConfigError, match="needs a synchronous algorithm"):
        make_config({"engine": "batched", "algorithm": "gossip", "lr_schedule": "cosine"})


def test_both_engines_take_the_first_iterations_steps_at_the_warm_up_rate(tmp_path):
    from helpers.engines import BASE, batched_states, process_engine_states

    one = {**BASE, "iterations": 1, "test_after": 1}
    warm = {**one, "lr": 0.2, "lr_schedule": "cosine:warmup=4"}  # iteration 0: a quarter of lr
    slow = {**one, "lr": 0.05}
    for states in (process_engine_states, lambda values: batched_states(values, tmp_path / str(len(values)), "on")):
        warmed, plain, fast = states(warm), states(slow), states({**one, "lr": 0.2})
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(warmed, plain))
        assert not torch.allclose(warmed[0], fast[0])
