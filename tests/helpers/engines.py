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


def metropolis_average(links, state: torch.Tensor, arrived: torch.Tensor | None = None) -> torch.Tensor:
    """The batched engine's D-PSGD average of ``state`` over ``links`` (``arrived``: per link,
    whether its model came in time; a late one's weight stays with the receiver's own)."""
    from meshlearn.batched.mixing import mixing_matrix

    heard = torch.ones(len(links), dtype=torch.bool) if arrived is None else arrived
    weight = links.weight * heard.to(links.weight.dtype)  # a late link weighs nothing ...
    own = 1.0 - links.incoming(links.weight) + links.incoming(links.weight - weight)  # ... its share stays home
    return torch.sparse.mm(mixing_matrix(links, weight, own, state.dtype), state)
