"""FedAvg's cohort path in the batched engine: clients exist while drawn, what they keep between draws
is stored sparsely (spilled to files past a budget), and the run's models, clocks and traffic are
those of the path that keeps a row per node."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from meshlearn.batched import BatchedSimulation
from meshlearn.batched.clientstate import ClientStates
from meshlearn.batched.cohort import cohort_refusal
from meshlearn.config import make_config
from meshlearn.data import ShardLoaders, loader_seed
from meshlearn.errors import ConfigError, DatasetError
from meshlearn.runlog import read_jsonl
from meshlearn.sim import simulate
from meshlearn.topology import build_topology

SMALL = {"engine": "batched", "dataset": "digits", "model": "mlp", "nodes": 20, "algorithm": "fedavg",
         "iterations": 6, "rounds": 3, "test_after": 3, "seed": 2, "step_time": 0.001, "momentum": 0.9}


def test_client_states_spill_past_the_budget_and_come_back_whole(tmp_path):
    states = ClientStates(budget=3000, spill=tmp_path / "spill")
    rows = {client: {"a": np.full(100, client, dtype=np.float64), "b": np.arange(client + 1)} for client in range(8)}
    for client, entry in rows.items():
        states.put(client, entry)
    assert len(states) == 8 and 0 < states.spilled < 8 and states.held_bytes <= 3000 + 800 + 64
    assert sorted(p.name for p in (tmp_path / "spill").iterdir()) == [f"client-{c}.npz" for c in range(states.spilled)]
    saved = states.state_dict()  # a checkpoint holds every entry, spilled or not
    for client, entry in rows.items():  # each comes back, from memory or from its file
        got = states.get(client)
        assert got.keys() == entry.keys() and all(np.array_equal(got[k], entry[k]) for k in entry)
    assert states.get(99) is None and 99 not in states
    fresh = ClientStates(budget=10 ** 6)
    fresh.load_state(saved)
    assert all(np.array_equal(fresh.get(c)["a"], rows[c]["a"]) for c in rows)
    states.close()
    assert not (tmp_path / "spill").exists()
    with pytest.raises(Exception, match="client states are damaged"):
        fresh.load_state({"entries": {"x": 1}})


def test_a_clients_stream_taken_on_later_gives_the_batches_of_one_never_interrupted():
    shard = np.arange(10)
    whole = ShardLoaders([shard], 4, [loader_seed(5, 3)])
    first = [whole.next()[0][1].tolist() for _ in range(7)]
    cut = ShardLoaders([shard], 4, [loader_seed(5, 3)])
    head = [cut.next()[0][1].tolist() for _ in range(3)]
    kept = cut.node_state(0)
    again = ShardLoaders([shard], 4, [loader_seed(5, 3)])  # a new round's loader, its state put back
    again.set_node_state(0, kept)
    assert head + [again.next()[0][1].tolist() for _ in range(4)] == first
    with pytest.raises(ValueError, match="does not fit"):
        ShardLoaders([np.arange(3)], 4, [1]).set_node_state(0, kept)


def _run(tmp_path, name: str, **extra):
    config = make_config({**SMALL, **extra, "output": str(tmp_path / name)})
    simulate(config, progress=False)
    return tmp_path / name


@pytest.mark.parametrize("extra", [{"fedavg_cohort": 5}, {"fedavg_fraction": 0.5, "outer": "adam:lr=0.01",
                                                         "net": "delay=5ms,jitter=2ms"}, {}],
                         ids=["cohort-5-momentum", "half-fedadam-jitter", "everyone"])
def test_the_cohort_path_gives_the_models_clocks_and_traffic_of_a_row_per_node(tmp_path, extra):
    cohort, rows = _run(tmp_path, "cohort", **extra), _run(tmp_path, "rows", batched_cohort="off", **extra)
    models = load_file(cohort / "model.safetensors"), load_file(rows / "model.safetensors")
    assert all(torch.allclose(models[0][k], models[1][k], atol=1e-6, rtol=0) for k in models[0])
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in (cohort, rows)]
    assert summaries[0]["bytes_sent"] == summaries[1]["bytes_sent"] > 0
    assert summaries[0]["elapsed_max"] == pytest.approx(summaries[1]["elapsed_max"], rel=1e-12)
    assert summaries[0]["final"]["accuracy"] == pytest.approx(summaries[1]["final"]["accuracy"], abs=1e-3)
    start = next(e for e in read_jsonl(cohort / "logs" / "nodes.jsonl") if e["event"] == "start")
    assert start["ranks"] == [0] and start["population"] == 20


def test_a_population_of_100000_holds_rows_for_its_cohort_only(tmp_path):
    config = make_config({**SMALL, "nodes": 100_000, "dataset": "synthetic:1,1", "partition": "writers",
                          "fedavg_cohort": 50, "iterations": 2, "rounds": 2, "test_after": 2, "momentum": 0.0,
                          "output": str(tmp_path)})
    simulation = BatchedSimulation(config, build_topology("star", 100_000, 2), tmp_path / "logs")
    summaries = simulation.run()
    assert simulation.stacked.stacked.state.shape[0] == 1 + 50  # the server's row and the cohort's
    assert simulation.stacked.state.shape[0] == 100_000  # every node's model: the server's, a view
    assert simulation.stacked.state.untyped_storage().nbytes() == simulation.stacked.stacked.state.nbytes
    iterations = [e for e in read_jsonl(tmp_path / "logs" / "nodes.jsonl") if e["event"] == "iteration"]
    assert [len(e["ranks"]) for e in iterations] == [len({0, *e["ranks"]}) for e in iterations]
    assert all(len(e["ranks"]) <= 51 for e in iterations)
    assert len(summaries) <= 1 + 2 * 50 and summaries[0]["metrics"]["accuracy"] > 0


def test_what_the_cohort_path_cannot_model_keeps_a_row_per_node():
    base = {"algorithm": "fedavg", "engine": "batched"}
    assert cohort_refusal(make_config(base)) is None
    for extra, said in (({"fedavg_compress": "int8"}, "error feedback"), ({"aggregation": "median"}, "judges"),
                        ({"optimizer": "adam"}, "adam"), ({"batched_cohort": "off"}, "off"),
                        ({"algorithm": "dpsgd"}, "dpsgd")):
        assert said in cohort_refusal(make_config({**base, **extra}))
    with pytest.raises(ConfigError, match="not both"):
        make_config({**base, "fedavg_cohort": 5, "fedavg_fraction": 0.5})


def test_a_population_too_large_to_hold_is_refused_in_one_line_off_the_cohort_path(tmp_path):
    config = make_config({**SMALL, "nodes": 30_000, "dataset": "synthetic:1,1", "partition": "writers",
                          "batched_cohort": "off", "output": str(tmp_path)})
    with pytest.raises(DatasetError, match="--fedavg-cohort"):
        BatchedSimulation(config, build_topology("star", 30_000, 2), tmp_path / "logs").run()


def test_rows_that_cannot_fit_are_refused_in_one_line_before_anything_is_allocated(tmp_path):
    from meshlearn.batched.engine import refuse_rows_beyond_memory
    from meshlearn.models import build_model

    config = make_config({**SMALL, "nodes": 20_000, "fedavg_compress": "int8"})
    model = build_model("mlp", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match=r"20,000 nodes of 0\.44 MB each need at least 17\.5 GB.*because "
                                          r"fedavg_compress int8 keeps error feedback per node"):
        refuse_rows_beyond_memory(config, model, 20_000, available=8 * 10 ** 9)
    refuse_rows_beyond_memory(config, model, 20_000, available=20 * 10 ** 9)  # fits: nothing said
