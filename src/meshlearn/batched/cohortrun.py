"""A batched run on the cohort path (``batched.cohort``): built with one row for the server's model
and one per client of a round's cohort, whatever the population, and driven iteration by
iteration as every batched run is (``iterations.drive``), its log naming each iteration's
participants instead of every node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshlearn.batched.algorithms import BatchedContext, Traffic
from meshlearn.batched.algorithms.cohort import BatchedCohort
from meshlearn.batched.clientstate import ClientStates
from meshlearn.batched.clock import VirtualClocks
from meshlearn.batched.cohort import SERVER_ROW, CohortBatches, client_samples
from meshlearn.batched.lockstep import Lockstep, Run
from meshlearn.batched.mixing import Links
from meshlearn.batched.models import NodeModels
from meshlearn.batched.network import ModelledNetwork
from meshlearn.batched.setup import (
    batches_per_epoch,
    modelled_step_time,
    run_data,
    training_chunk,
    vectorize,
    worker_counts,
)
from meshlearn.batched.shards import Collective
from meshlearn.batched.stacked import StackedState
from meshlearn.data import partition_dataset
from meshlearn.models import build_model
from meshlearn.optim import optimizer_of
from meshlearn.runlog import JsonlLog
from meshlearn.tasks import task_of


@dataclass
class _CohortRun(Run):
    """A run whose rows are the server's and a cohort's (``BatchedCohort``); ``population`` clients."""

    population: int = 0

    def started_ranks(self) -> list[int]:
        """The server only: the population is said in numbers (``population_fields``)."""
        return [SERVER_ROW]

    def population_fields(self) -> dict[str, Any]:
        return {"population": self.population, "cohort": self.algorithm.capacity,
                "population_samples": int(np.sum(self.samples))}

    def final_ranks(self) -> list[int]:
        """The server and every client any round drew (the others did nothing)."""
        rules = self.algorithm.rules
        drawn = {client for iteration in range(self.config.iterations) for client in rules.cohort(iteration)}
        return sorted(drawn | {SERVER_ROW})

    def consensus(self) -> float:
        """0: every client of a round starts from the server's model, the only one kept."""
        return 0.0

    def average_evaluation(self, rows: torch.Tensor | None = None) -> None:
        """None: the server's model is the only one kept, evaluated as every node's."""
        return None

    def close(self) -> None:
        """As every run's, and the clients' spilled state removed (a checkpoint holds all of it)."""
        super().close()
        self.algorithm.states.close()


class PopulationStates:
    """Every node's model on the cohort path, as ``StackedState`` shows every node's: the server's
    model, which each node takes (a drawn client's own exists only within its round), as a view of
    one row for all ``population`` nodes; the rest is the run's ``stacked``."""

    def __init__(self, stacked: StackedState, population: int):
        self.stacked, self.population = stacked, population

    @property
    def state(self) -> torch.Tensor:
        """[population, P]: the server's row, seen by every node (a view, no copy)."""
        return self.stacked.state[SERVER_ROW:SERVER_ROW + 1].expand(self.population, -1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stacked, name)


class _CohortLockstep(Lockstep):
    """The iteration steps of a cohort run: the cohort's rows train, the clocks of its clients
    advance, and each event names the iteration's participants."""

    def train(self, iteration: int) -> tuple[list, np.ndarray]:
        run = self.run
        rows = run.algorithm.trainers(iteration)
        losses = run.train(rows)
        return losses, run.clocks.train(run.steps, run.algorithm.clients)

    def exchange(self, iteration: int, trained: tuple[list, np.ndarray]) -> tuple[list, dict]:
        (losses, compute), algorithm = trained, self.run.algorithm
        columns = algorithm.after_local_steps(iteration)
        ranks = algorithm.participants()
        row_of = {client: SERVER_ROW + 1 + j for j, client in enumerate(algorithm.clients)}
        zeros = np.zeros(len(ranks))
        return [losses[row_of[rank]] if rank in row_of else None for rank in ranks], \
            {"train": compute[ranks], "encode": zeros, "average": zeros, **columns}

    def logged(self) -> list[int]:
        return self.run.algorithm.participants()


def build_cohort_run(simulation: Any) -> _CohortRun:
    """Everything a cohort run of ``simulation`` (an ``engine.BatchedSimulation``) needs: the data (a generated population's users are made when drawn),
    the rows of the server and of one cohort, the clients' sparse state, clocks for the population."""
    config, graph, shard = simulation.config, simulation.graph, simulation.shard
    dataset, validation = run_data(config, whole=False)
    parts = None if getattr(dataset, "population", None) is not None else \
        partition_dataset(dataset, config.nodes, config.partition, config.seed)
    samples = client_samples(dataset, parts)
    sizes = samples.sizes
    device = torch.device(config.device)
    torch.manual_seed(config.seed)  # the one initial model, as every engine's
    model = build_model(config.model, dataset.input_shape, dataset.num_classes).to(device)
    first = np.arange(min(int(sizes[0]), config.batch_size)) if parts is None else parts[0]
    simulation.step_time = modelled_step_time(model, dataset, first, config)
    cohort = config.settings_of("fedavg").drawn(config.nodes)
    stacked = StackedState(model, 1 + cohort, device)
    simulation.stacked = PopulationStates(stacked, config.nodes)
    vectorized = vectorize(config, model)
    chunk = training_chunk(config, model, dataset.normalize(dataset.train_x[:1])[0]) if vectorized else 0
    steps = config.rounds * (batches_per_epoch(sizes, config.batch_size) if config.full_epochs else 1)
    models = NodeModels(stacked, vectorized, chunk, *worker_counts(config), loss_of=task_of(dataset).loss)
    nobody = np.zeros(0, dtype=np.int64)
    links = Links(config.nodes, config.nodes, *(torch.zeros(0, dtype=torch.int64),) * 3,
                  torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.int64))
    clocks = VirtualClocks(config, simulation.step_time, stacked.row_bytes, nobody, nobody)
    traffic = Traffic(config.nodes)
    optimizer = optimizer_of(config, stacked.params)
    states = ClientStates(config.batched.client_memory, simulation.log_path.parent / "clients")
    batches = CohortBatches(samples, config.batch_size, config.seed, states, device)
    context = BatchedContext(config, graph, stacked, links, clocks, shard, links, Collective(shard),
                             samples=sizes, network=ModelledNetwork(config, clocks, traffic))
    algorithm = BatchedCohort(context, traffic, batches, states, optimizer)
    models.fuse(optimizer)
    server = slice(SERVER_ROW, SERVER_ROW + 1)
    return _CohortRun(
        config=config, shard=shard, collective=context.collective, dataset=dataset, validation=validation,
        shards=parts, stacked=stacked, models=models, sgd=optimizer, batches=batches, clocks=clocks,
        traffic=traffic, algorithm=algorithm, ranks=[SERVER_ROW],
        evaluating=[SERVER_ROW] if config.node_evaluates(SERVER_ROW) else [], samples=sizes,
        outer=config.outer.begin(stacked.params[server]) if config.outer.active else None,
        log=JsonlLog(simulation.log_path, append=simulation.resume is not None), steps=steps,
        lockstep=_CohortLockstep, outer_rows=server, population=config.nodes)
