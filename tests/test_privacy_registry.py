"""The registry of privacy mechanisms: the built-in ones by name, and a toy one that is one file and
one registration (tests/helpers/toy_privacy.py: a seeded perturbation of each local step), whose
hook both engines call in their real runs and whose conflict the configuration checks."""

import json
from pathlib import Path

import pytest
import torch
from helpers.engines import BASE, batched_states

from meshlearn.config import make_config
from meshlearn.errors import ConfigError
from meshlearn.node import build_node
from meshlearn.plugins import load_user_module
from meshlearn.privacy.mechanism import (
    PRIVACY_MECHANISMS,
    Privacy,
    PrivateNodes,
    active_mechanisms,
)
from meshlearn.runlog import COLUMNAR_LOG, per_node
from meshlearn.sim.inprocess import run_threads
from meshlearn.topology import build_topology

TOY = Path(__file__).parent / "helpers" / "toy_privacy.py"
VALUES = {**BASE, "iterations": 2}  # 6 nodes of D-PSGD, 2 local steps an iteration
STEPS = VALUES["iterations"] * VALUES["rounds"]


def test_the_built_in_mechanisms_are_the_settings_users_write():
    assert {"dp-sgd", "secure-aggregation", "central-dp"} <= set(PRIVACY_MECHANISMS.names())
    assert active_mechanisms(make_config({})) == []
    config = make_config({"algorithm": "leader", "leader_sync": True, "leader_weighting": "equal", "nodes": 4,
                          "secure_aggregation": True, "central_dp": "noise_multiplier=1", "dp": "epsilon=8"})
    assert [m.name for m in active_mechanisms(config)] == ["dp-sgd", "secure-aggregation", "central-dp"]
    privacy = Privacy.of(config, PrivateNodes((0,), (100,), 2, "cpu", 10))
    assert privacy.clip_norm == 1.0 and privacy.masks and privacy.noise is not None
    assert not Privacy().changes_steps and Privacy().noise is None and Privacy().report(0) == {}


def _process_engine(values: dict) -> tuple[list[torch.Tensor], list[dict]]:
    """Every node's final state and privacy report from the process engine's nodes (threads of this
    process, real ZeroMQ sockets on loopback)."""
    config = make_config(values)
    graph = build_topology(config.topology, config.nodes, config.seed)
    nodes = [build_node(config, rank, graph) for rank in range(config.nodes)]
    run_threads(nodes, timeout=120)
    return [node.flat.state.clone() for node in nodes], [node.privacy.report(0) for node in nodes]


def _final_columns(log: Path) -> list[dict]:
    """Each node's final event in a batched run's log."""
    return [event for line in log.open() if '"final"' in line for event in per_node(json.loads(line))]


def test_a_toy_mechanism_registered_by_a_module_changes_both_engines_steps_alike(tmp_path):
    toy = {**VALUES, "models_module": str(TOY), "privacy": "toy-perturbation"}
    batched = batched_states(toy, tmp_path / "toy", "on").clone()
    assert "toy-perturbation" in PRIVACY_MECHANISMS.extensions()  # the module's one registration
    finals = _final_columns(tmp_path / "toy" / "on" / COLUMNAR_LOG)
    assert [event["toy_privacy"] for event in finals] == [{"steps": STEPS}] * VALUES["nodes"]  # each node's steps

    plain = batched_states({**VALUES, "models_module": str(TOY)}, tmp_path / "plain", "on")  # registered, not asked
    assert all("toy_privacy" not in event for event in _final_columns(tmp_path / "plain" / "on" / COLUMNAR_LOG))
    assert (batched - plain).abs().max() > 1e-3  # the perturbation changed what every node learnt

    process, reports = _process_engine(toy)
    assert reports == [{"toy_privacy": {"steps": STEPS}}] * VALUES["nodes"]
    for rank, state in enumerate(process):  # the one hook, the same perturbation, in either engine
        assert torch.allclose(batched[rank], state, atol=1e-5, rtol=0), rank


def test_a_mechanisms_conflicts_are_checked_with_the_configuration():
    load_user_module(TOY)
    with pytest.raises(ConfigError, match="privacy toy-perturbation needs dp none .*; or use privacy without it"):
        make_config({**VALUES, "models_module": str(TOY), "privacy": "toy-perturbation", "dp": "noise_multiplier=1"})
    with pytest.raises(ConfigError, match="dp-sgd is built in: ask for it by its own setting"):
        make_config({**VALUES, "privacy": "dp-sgd"})
    make_config({**VALUES, "dp": "noise_multiplier=1"})  # a run that does not use it is not refused


def test_a_mechanism_no_module_registered_is_refused_in_one_line_when_the_run_starts(tmp_path):
    with pytest.raises(ConfigError, match="unknown privacy mechanism 'toy-perturbatio'.*did you mean"):
        batched_states({**VALUES, "models_module": str(TOY), "privacy": "toy-perturbatio"}, tmp_path / "typo", "on")
