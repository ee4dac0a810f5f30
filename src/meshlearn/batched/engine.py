"""The batched engine: every node of a run in this process, trained together, timed by a model.

The same experiment as the process engine (same partitions, initial model, batch order, SGD and
averaging), computed for all nodes at once on an [N, P] state. Its log is one columnar file,
``logs/nodes.jsonl`` (``runlog.columnar_event``): one line per iteration for all nodes, which the
report reads like the process engine's per-node logs. Times in it are modelled (``clock``).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from meshlearn.batched.algorithms import BATCHED_ALGORITHMS, BatchedContext, Traffic
from meshlearn.batched.batches import NodeBatches
from meshlearn.batched.clock import VirtualClocks
from meshlearn.batched.evaluate import evaluate_nodes
from meshlearn.batched.mixing import Links
from meshlearn.batched.models import NodeModels, has_convolutions
from meshlearn.sgd import StackedSGD
from meshlearn.batched.shards import Collective, Shard, halo_plan
from meshlearn.batched.stacked import StackedState, consensus_distance
from meshlearn.config import ExperimentConfig
from meshlearn.data import Dataset, load_dataset, partition
from meshlearn.evaluation import Evaluation
from meshlearn.models import build_model
from meshlearn.plugins import load_user_module
from meshlearn.runlog import COLUMNAR_LOG, JsonlLog, columnar_event
from meshlearn.topology import Graph

MEASURED_STEPS = 5
Progress = Callable[[int], None]


def vectorize(config: ExperimentConfig, model: nn.Module) -> bool:
    """Whether the run trains its nodes in vectorized calls (``batched_vectorize``; auto: yes,
    except for a model with convolutions on the CPU)."""
    choice = config.batched.vectorize
    if choice != "auto":
        return choice == "on"
    return not (config.device == "cpu" and has_convolutions(model))


def measure_step_time(model: nn.Module, dataset: Dataset, indices: np.ndarray, config: ExperimentConfig) -> float:
    """Seconds of one node's local SGD step, alone (the fastest of a few, after a warm-up: other
    load on the machine only ever adds): the modelled compute time of a step. Leaves torch's
    random state as it was."""
    device = torch.device(config.device)
    with torch.random.fork_rng(devices=[]):
        alone = copy.deepcopy(model).to(device).train()
        optimizer = torch.optim.SGD(alone.parameters(), lr=config.lr, momentum=config.momentum,
                                    weight_decay=config.weight_decay)
        batch = torch.as_tensor(indices[:config.batch_size])
        x, y = dataset.normalize(dataset.train_x[batch]).to(device), dataset.train_y[batch].to(device)
        times = []
        for _ in range(MEASURED_STEPS + 1):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(alone(x), y).backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return min(times[1:])


class BatchedSimulation:
    """One run of ``config`` (``engine: batched``) over ``graph``, logging to ``log_dir``; under
    ``torchrun`` one process of it, holding the nodes of ``shard`` (the first process writes the
    log). The constructor only records; ``run()`` loads the data, trains and writes the log."""

    def __init__(self, config: ExperimentConfig, graph: Graph, log_dir: str | Path,
                 progress: Progress | None = None, shard: Shard | None = None):
        self.config = config
        self.graph = graph
        self.log_path = Path(log_dir) / COLUMNAR_LOG
        self.progress = progress
        self.shard = shard or Shard(0, 1, 0, config.nodes, config.nodes)
        self.stacked: StackedState | None = None  # after run(): the final state of this process's nodes
        self.step_time = 0.0

    def run(self) -> dict[int, dict[str, Any]]:
        """Train every node for the configured iterations; returns each node's final summary (in
        the first process; the others return none)."""
        config, graph, shard = self.config, self.graph, self.shard
        collective = Collective(shard)
        if config.models_module:
            load_user_module(config.models_module)
        dataset = load_dataset(config.dataset)
        parts = partition(dataset.train_y.numpy(), config.nodes, config.partition, config.seed)
        device = torch.device(config.device)
        torch.manual_seed(config.seed)  # every node starts from this one model, as in the process engine
        model = build_model(config.model, dataset.input_shape, dataset.num_classes).to(device)
        self.step_time = collective.broadcast(
            config.batched.step_time or (measure_step_time(model, dataset, parts[0], config) if shard.main else 0.0))
        stacked = self.stacked = StackedState(model, shard.size, device)
        models = NodeModels(stacked, vectorize(config, model), config.batched.chunk)
        sgd = StackedSGD(stacked.params, config.lr, config.momentum, config.weight_decay)
        batches = NodeBatches(dataset, parts[shard.start:shard.stop], config.batch_size, config.seed, device,
                              first_rank=shard.start)
        links = Links(graph, device)
        sender, receiver = links.sender.cpu().numpy(), links.receiver.cpu().numpy()
        plan, local = None, links
        if shard.count > 1:
            plan = halo_plan(sender, receiver, shard, device)
            local = links.local(shard.start, shard.stop, plan.extended_index(shard))
        clocks = VirtualClocks(config, self.step_time, stacked.row_bytes, sender, receiver)
        traffic = Traffic(config.nodes)
        algorithm = BATCHED_ALGORITHMS.get(config.algorithm)(
            BatchedContext(config, graph, stacked, links, clocks, shard, local, collective, plan), traffic)
        ranks = list(range(config.nodes))
        evaluating = [rank for rank in shard.ranks if config.node_evaluates(rank)]
        log = JsonlLog(self.log_path) if shard.main else None
        try:
            if log is not None:
                log.write(columnar_event(
                    "start", ranks, {"neighbours": [graph.neighbours(r) for r in ranks],
                                     "samples": [len(part) for part in parts]},
                    parameters=stacked.param_count, state_bytes=stacked.row_bytes, threads=torch.get_num_threads(),
                    time=time.time(), engine="batched", vectorized=models.vectorized, step_time=self.step_time,
                    processes=shard.count))
            began = time.perf_counter()
            for iteration in range(config.iterations):
                losses = torch.zeros(shard.size, dtype=torch.float64)
                for _ in range(config.rounds):
                    grads, loss = models.gradients(batches.next())
                    sgd.step(grads)
                    losses += loss.double().cpu()
                compute = clocks.train(config.rounds)
                columns = {"train": compute, "encode": np.zeros(config.nodes), "average": np.zeros(config.nodes),
                           **algorithm.after_local_steps(iteration)}
                train_loss = collective.gather((losses / config.rounds).tolist() if config.rounds
                                               else [None] * shard.size)
                columns["t"] = clocks.now
                done = iteration + 1
                evaluation = None
                if done % config.test_after == 0 or done == config.iterations:
                    evaluation = collective.gather(_evaluations(models, evaluating, shard.start, dataset, config.eval_samples))
                    consensus = consensus_distance(collective.sum_(stacked.consensus_sums()))
                if log is not None:
                    columns["train_loss"] = train_loss
                    log.write(columnar_event("iteration", ranks, _lists(columns), iteration=iteration,
                                             wall=time.perf_counter() - began))  # real seconds, for benchmarks
                    if evaluation:
                        tested = [rank for rank, _ in evaluation]
                        log.write(columnar_event(
                            "eval", tested, {"t": [float(clocks.now[r]) for r in tested],
                                             "test_loss": [e.loss for _, e in evaluation],
                                             "test_acc": [e.accuracy for _, e in evaluation]},
                            iteration=done, consensus=consensus))
                if self.progress is not None:
                    self.progress(done)
            final = collective.gather(_evaluations(models, evaluating, shard.start, dataset, config.eval_samples, full=True))
            if log is None:
                return {}
            final_by_rank = dict(final)
            summaries = {rank: self._summary(rank, final_by_rank.get(rank), traffic, float(clocks.now[rank]))
                         for rank in ranks}
            log.write(columnar_event("final", ranks, {
                "metrics": [summaries[r]["metrics"] for r in ranks], "stats": [summaries[r]["stats"] for r in ranks],
                "elapsed": [summaries[r]["elapsed"] for r in ranks]}, clock="modelled"))
            return summaries
        finally:
            if log is not None:
                log.close()

    @staticmethod
    def _summary(rank: int, final: Evaluation | None, traffic: Traffic, elapsed: float) -> dict[str, Any]:
        return {"event": "final", "rank": rank, "elapsed": elapsed, "stats": traffic.of(rank),
                "metrics": None if final is None else final.__dict__}


def _evaluations(models: NodeModels, ranks: list[int], first: int, dataset: Dataset, limit: int,
                 full: bool = False) -> list[tuple[int, Evaluation]]:
    """(rank, evaluation) of this process's evaluating nodes (global ``ranks``; its rows hold the
    nodes from global rank ``first`` on)."""
    results = evaluate_nodes(models, [rank - first for rank in ranks], dataset, limit, full)
    return [(rank, results[rank - first]) for rank in ranks]


def _lists(columns: dict[str, Any]) -> dict[str, list]:
    """Columns as JSON-ready lists (numpy and torch values to Python numbers)."""
    out = {}
    for name, values in columns.items():
        if isinstance(values, (np.ndarray, torch.Tensor)):
            values = values.tolist()
        out[name] = list(values)
    return out
