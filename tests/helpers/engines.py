"""The two engines on one configuration, in this process: every node's final state."""

import torch

from meshlearn.batched import BatchedSimulation
from meshlearn.config import make_config
from meshlearn.node import build_node
from meshlearn.sim.inprocess import run_threads
from meshlearn.topology import build_topology

BASE = {"nodes": 6, "topology": "regular:3", "dataset": "digits", "model": "mlp", "iterations": 5, "rounds": 2,
        "batch_size": 16, "lr": 0.05, "test_after": 100, "seed": 3, "wait_timeout": 60}


def process_engine_states(values: dict) -> list[torch.Tensor]:
    """Every node's final state from the process engine's nodes (threads of this process, real
    ZeroMQ sockets on loopback)."""
    config = make_config(values)
    graph = build_topology(config.topology, config.nodes, config.seed)
    nodes = [build_node(config, rank, graph) for rank in range(config.nodes)]
    run_threads(nodes, timeout=120)
    return [node.flat.state.clone() for node in nodes]


def batched_states(values: dict, tmp_path, vectorize: str) -> torch.Tensor:
    config = make_config({**values, "engine": "batched", "batched_vectorize": vectorize, "step_time": 0.001})
    simulation = BatchedSimulation(config, build_topology(config.topology, config.nodes, config.seed),
                                   tmp_path / vectorize)
    simulation.run()
    return simulation.stacked.state
