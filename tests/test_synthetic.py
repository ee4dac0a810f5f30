"""The FedProx paper's synthetic federated data set (``synthetic:ALPHA,BETA``): the agreed generator
bit for bit, users on demand, and runs on both engines."""

import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from meshlearn.config import make_config
from meshlearn.data import load_dataset, parse_spec, partition_dataset
from meshlearn.data.synthetic import (
    MAX_MATERIALIZED,
    TEST_USERS,
    SyntheticPopulation,
    load_synthetic,
    require_materialized,
)
from meshlearn.errors import DatasetError
from meshlearn.sim import simulate


def _by_hand(alpha: float, beta: float, users: int, seed: int, k: int):
    """User k as the agreed generator writes it, with numpy alone: (train x, train y, test x, test y)."""
    s = np.random.default_rng([seed, 0x5EED, 0]).lognormal(4.0, 2.0, users).astype(np.int64) + 50
    s = np.minimum(s, 1000)
    train = s[k] - s[k] // 10
    sigma = np.arange(1, 61, dtype=np.float64) ** -1.2
    rng = np.random.default_rng([seed, 0x5EED, 1, k])
    u = rng.normal(0.0, alpha)
    b_mean = rng.normal(0.0, beta)
    w = rng.normal(u, 1.0, (60, 10))
    b = rng.normal(u, 1.0, 10)
    v = rng.normal(b_mean, 1.0, 60)
    x = rng.normal(0.0, 1.0, (s[k], 60)) * np.sqrt(sigma) + v
    y = np.argmax(x @ w + b, axis=1)
    x, y = x.astype(np.float32), y.astype(np.int64)
    return x[:train], y[:train], x[train:], y[train:]


def test_user_3_of_seed_7_is_the_agreed_generator_bit_for_bit():
    train_x, train_y, test_x, test_y = _by_hand(1.0, 1.0, 10, 7, 3)
    population = SyntheticPopulation(1.0, 1.0, 10, 7)
    x, y = population.samples(3)
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and tuple(x.shape) == (len(train_y), 1, 1, 60)
    assert np.array_equal(x.numpy().reshape(-1, 60), train_x) and np.array_equal(y.numpy(), train_y)
    assert population.sizes[3] == len(train_y) and len(test_y) == (len(train_y) + len(test_y)) // 10
    dataset = load_synthetic(1.0, 1.0, 10, 7)
    start = int(population.sizes[:3].sum())  # the test set: users 0, 1, 2, then 3's test rows
    first = sum(len(_by_hand(1.0, 1.0, 10, 7, k)[3]) for k in range(3))
    assert np.array_equal(dataset.train_x[start:start + len(train_y)].numpy().reshape(-1, 60), train_x)
    assert np.array_equal(dataset.test_x[first:first + len(test_y)].numpy().reshape(-1, 60), test_x)
    assert np.array_equal(dataset.test_y[first:first + len(test_y)].numpy(), test_y)
    assert len(np.unique(dataset.train_y.numpy())) > 2  # labels are classes 0..9, not one class
    assert dataset.name == "synthetic(1,1)" and dataset.class_names == tuple("0123456789")
    assert dataset.mean == (0.0,) and dataset.std == (1.0,) and torch.equal(dataset.normalize(x), x)


def test_a_users_size_and_samples_do_not_depend_on_the_population():
    small, large = SyntheticPopulation(1.0, 1.0, 1000, 7), SyntheticPopulation(1.0, 1.0, 100_000, 7)
    assert np.array_equal(small.sizes, large.sizes[:1000]) and len(large.sizes) == 100_000
    assert small.sizes.min() >= 50 - 5 and large.sizes.max() <= 900  # 50 .. 1000 samples, 90% of them train
    assert all(torch.equal(a, b) for a, b in zip(small.samples(999), large.samples(999)))
    assert not np.array_equal(SyntheticPopulation(1.0, 1.0, 1000, 8).sizes, small.sizes)  # the seed draws them


def test_the_test_set_is_the_first_users_and_the_same_for_every_large_population():
    x, y = SyntheticPopulation(0.5, 0.5, TEST_USERS, 3).test_set()
    big_x, big_y = SyntheticPopulation(0.5, 0.5, 10_000, 3).test_set()
    assert torch.equal(x, big_x) and torch.equal(y, big_y)
    few = SyntheticPopulation(0.5, 0.5, 20, 3)
    few_x, _ = few.test_set()
    assert torch.equal(few_x, x[:len(few_x)]) and len(few_x) == int((few.totals // 10).sum())


def test_a_users_samples_are_its_rows_of_the_materialized_set_and_the_writers_partition_gives_it_one_node():
    dataset = load_dataset("synthetic:1,1", nodes=30, seed=5)
    population = dataset.population
    assert population == SyntheticPopulation(1.0, 1.0, 30, 5) and not dataset.population_only
    assert len(dataset.train_y) == population.train_samples
    parts = partition_dataset(dataset, 30, "writers", seed=5)
    for k in (0, 17, 29):
        rows = np.flatnonzero(dataset.train_groups.numpy() == k)
        x, y = population.samples(k)
        assert np.array_equal(np.asarray(parts[k]), rows) and len(rows) == population.sizes[k]
        assert torch.equal(dataset.train_x[rows], x) and torch.equal(dataset.train_y[rows], y)
    require_materialized(dataset)  # it holds every user: any engine runs it
    iid = partition_dataset(dataset, 30, "iid", seed=5)
    assert sum(len(p) for p in iid) == len(dataset.train_y)


def test_beta_moves_the_users_inputs_and_alpha_shifts_every_class_alike():
    base = SyntheticPopulation(1.0, 1.0, 5, 7)
    x, y = base.samples(2)
    other_beta = SyntheticPopulation(1.0, 0.0, 5, 7)
    assert not torch.equal(other_beta.samples(2)[0], x) and np.array_equal(other_beta.sizes, base.sizes)
    iid = SyntheticPopulation(0.0, 0.0, 5, 7)  # every user's inputs centred alike: their means differ far less
    spread = [np.ptp([p.samples(k)[0].mean().item() for k in range(5)]) for p in (iid, base)]
    assert spread[0] < spread[1] / 3
    # ALPHA moves all of a user's W and b by the same u: every class's logit gains u * (sum(x) + 1), so
    # no argmax, no label, changes (as in the FedProx paper's generator): ALPHA's data are BETA's
    for alpha in (0.0, 5.0):
        assert all(torch.equal(a, b) for a, b in zip(SyntheticPopulation(alpha, 1.0, 5, 7).samples(2), (x, y)))


def test_a_population_of_100000_users_costs_its_size_table_and_generates_a_user_when_asked():
    tracemalloc.start()
    try:
        population = SyntheticPopulation(1.0, 1.0, 100_000, 7)
        x, y = population.samples(99_999)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert population.train_samples > MAX_MATERIALIZED  # over 20 million samples: 5 GB as float32
    assert peak < 20 * 1024 ** 2 and len(y) == population.sizes[99_999] and x.shape[1:] == (1, 1, 60)
    dataset = load_synthetic(1.0, 1.0, 100_000, 7)
    assert dataset.population_only and dataset.population == population
    assert len(dataset.train_y) == int(population.sizes[:TEST_USERS].sum())
    assert int(dataset.train_groups.max()) == TEST_USERS - 1
    with pytest.raises(DatasetError, match="--fedavg-cohort") as refused:
        require_materialized(dataset)
    assert "\n" not in str(refused.value) and "100,000 users" in str(refused.value)


@pytest.mark.parametrize("spec", ["synthetic", "synthetic:x", "synthetic:1", "synthetic:-1,1", "synthetic:1,1,1",
                                  "synthetic:nan,1", "synthetic:1,inf"])
def test_a_bad_synthetic_spec_is_refused_in_one_line(spec):
    with pytest.raises(DatasetError, match="synthetic:ALPHA,BETA") as refused:
        parse_spec(spec)
    assert "\n" not in str(refused.value)


def test_the_command_line_refuses_a_bad_spec_in_one_line_and_other_services_refuse_a_nodeless_one(tmp_path):
    result = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--dataset", "synthetic:1",
                             "--output", str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                            check=False)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "synthetic:ALPHA,BETA" in lines[0], result.stderr
    assert parse_spec("Synthetic:0.5,0") == ("synthetic", None)
    with pytest.raises(DatasetError, match="one user per node"):
        load_dataset("synthetic:1,1")  # no node count: the network service's providers share no population


def _majority(dataset) -> float:
    """The test accuracy of always answering the test set's most common class."""
    return float(np.bincount(dataset.test_y.numpy()).max() / len(dataset.test_y))


@pytest.mark.parametrize("engine,nodes,iterations", [("batched", 20, 10), ("process", 4, 2)])
def test_a_run_on_synthetic_data_learns_more_than_the_majority_class(tmp_path, engine, nodes, iterations):
    settings = {"engine": engine, "nodes": nodes, "iterations": iterations, "test_after": iterations,
                "dataset": "synthetic:1,1", "partition": "writers", "model": "mlp", "rounds": 10, "lr": 0.1,
                "seed": 90, "step_time": 0.001, "output": str(tmp_path)}
    if engine == "batched":
        settings.update(algorithm="fedavg", fedavg_fraction=0.5)
    simulate(make_config(settings), progress=False)
    final = json.loads((tmp_path / "summary.json").read_text())["final"]
    assert final["accuracy"] > _majority(load_dataset("synthetic:1,1", nodes=nodes, seed=90)) + 0.05, final
