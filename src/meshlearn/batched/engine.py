"""The batched engine: every node of a run in this process, trained together, timed by a model.

The same experiment as the process engine (same partitions, initial model, batch order, SGD and
averaging), computed for all nodes at once on an [N, P] state. Its log is one columnar file,
``logs/nodes.jsonl`` (``runlog.columnar_event``): one line per iteration for all nodes, which the
report reads like the process engine's per-node logs. Times in it are modelled (``clock``).

A lockstep run keeps checkpoints (``checkpoint``: every node's state, optimizer, batch order,
clocks, counters, the algorithm's state and the random generators) and resumes from one to the
same final models as a run never interrupted. An asynchronous algorithm's run keeps none: its
event queue is in flight between any two iterations.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from meshlearn.batched.algorithms import (
    BatchedAlgorithm,
    BatchedContext,
    Traffic,
    make_batched_algorithm,
)
from meshlearn.batched.batches import NodeBatches
from meshlearn.batched.byzantine import flipped_labels
from meshlearn.batched.clock import VirtualClocks
from meshlearn.batched.evaluate import evaluate_nodes
from meshlearn.batched.memory import keep_freed_memory
from meshlearn.batched.mixing import Links
from meshlearn.batched.models import NodeModels, has_convolutions
from meshlearn.batched.network import ModelledNetwork
from meshlearn.batched.shards import Collective, Shard, halo_plan
from meshlearn.batched.stacked import StackedState, consensus_distance
from meshlearn.batched.workers import WorkerChoice, available_cores, intra_op_threads
from meshlearn.checkpoint import RunCheckpoints
from meshlearn.config import ExperimentConfig, load_run_dataset
from meshlearn.data import (
    Dataset,
    partition_dataset,
    shard_as_test_set,
    split_validation,
)
from meshlearn.data.vocabulary import model_metadata
from meshlearn.definitions.base import definition
from meshlearn.errors import CheckpointError, ConfigError
from meshlearn.flat import FlatState
from meshlearn.iterations import (
    IterationSteps,
    drive,
    evaluation_due,
    evaluation_fields,
    more_evaluations,
    restore_run,
)
from meshlearn.metrics import Evaluation
from meshlearn.models import MODEL_FILE, build_model, save_weights
from meshlearn.models.cost import saved_activation_bytes, step_flops
from meshlearn.optim import make_optimizer, steps_rows_apart
from meshlearn.plugins import load_user_module
from meshlearn.privacy.dpsgd import secret_seed
from meshlearn.privacy.mechanism import Privacy, PrivateNodes, secret_batches
from meshlearn.runlog import COLUMNAR_LOG, JsonlLog, columnar_event
from meshlearn.sgd import local_step
from meshlearn.sharing import make_sharing
from meshlearn.tasks import task_of
from meshlearn.topology import Graph

MEASURED_STEPS = 5
# bytes of activations (``saved_activation_bytes`` x the batch) one vectorized training call may keep
# on the CPU: vmap's gradient peaks at about 3 times that (gpt-tiny on 32 windows of 64 tokens: 75 MB,
# 240 MB a node at the peak), and blocks of more nodes were no faster (docs/batched-engine.md)
ACTIVATIONS_PER_CALL = 128 * 2 ** 20
Progress = Callable[[int], None]


def vectorize(config: ExperimentConfig, model: nn.Module) -> bool:
    """Whether the run trains its nodes in vectorized calls (``batched_vectorize``; auto: yes,
    except for a model with convolutions on the CPU)."""
    choice = config.batched.vectorize
    if choice != "auto":
        return choice == "on"
    return not (config.device == "cpu" and has_convolutions(model))


def training_chunk(config: ExperimentConfig, model: nn.Module, sample: torch.Tensor) -> int:
    """Nodes per vectorized call (``batched_chunk``; 0 = auto: on the CPU, as many as keep a call's
    activations within ACTIVATIONS_PER_CALL, at least one; on a GPU, all) for ``model`` on inputs
    like ``sample`` (one, as the model reads it). The block size never changes a node's result, as
    the worker count does not."""
    if config.batched.chunk or config.device != "cpu":
        return config.batched.chunk
    per_node = config.batch_size * saved_activation_bytes(model, sample.unsqueeze(0))
    return max(1, ACTIVATIONS_PER_CALL // max(1, per_node))


def worker_counts(config: ExperimentConfig) -> tuple[int, WorkerChoice]:
    """How many worker threads may train the nodes, and how the count for each step is chosen
    (``batched_workers``; auto: one, or one per available core, whichever the first steps find faster;
    one on a GPU, which is one device whatever the threads)."""
    if config.batched.workers:
        return config.batched.workers, WorkerChoice([config.batched.workers])
    cores = 1 if config.device != "cpu" else available_cores()
    return cores, WorkerChoice([1, cores])


def modelled_step_time(model: nn.Module, dataset: Dataset, indices: np.ndarray, config: ExperimentConfig) -> float:
    """Modelled seconds of one node's local SGD step: ``step_time`` where configured; else, by
    ``step_cost``, the model's counted FLOPs per step over ``device_gflops`` plus ``step_overhead``
    (the default: the same for a config on any machine, under any load), or ``measure_step_time``."""
    settings = config.batched
    if settings.step_time:
        return settings.step_time
    if settings.step_cost == "measured":
        return measure_step_time(model, dataset, indices, config)
    flops = step_flops(model, dataset.normalize(dataset.train_x[:1])[0], config.batch_size)
    return flops / (settings.device_gflops * 1e9) + settings.step_overhead


def measure_step_time(model: nn.Module, dataset: Dataset, indices: np.ndarray, config: ExperimentConfig) -> float:
    """Seconds of one node's local SGD step, alone (the fastest of a few, after a warm-up: other
    load on the machine only ever adds): the modelled compute time of a step. Leaves torch's
    random state as it was."""
    device = torch.device(config.device)
    with torch.random.fork_rng(devices=[]):
        alone = copy.deepcopy(model).to(device)
        flat = FlatState(alone)
        optimizer = make_optimizer(config.optimizer, flat.params.unsqueeze(0), config.lr, config.momentum,
                                   config.weight_decay)
        parameters = list(alone.parameters())
        batch = torch.as_tensor(indices[:config.batch_size])
        x, y = dataset.normalize(dataset.train_x[batch]).to(device), dataset.train_y[batch].to(device)
        times = []
        for _ in range(MEASURED_STEPS + 1):
            start = time.perf_counter()
            local_step(alone, parameters, optimizer, x, y, task_of(dataset).loss)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return min(times[1:])


class BatchedSimulation:
    """One run of ``config`` (``engine: batched``) over ``graph``, logging to ``log_dir``; under
    ``torchrun`` one process of it, holding the nodes of ``shard`` (the first process writes the
    log). ``resume``: continue from the run's checkpoint of that iteration, in ``log_dir``'s results
    folder. The constructor only records; ``run()`` loads the data, trains and writes the log."""

    def __init__(self, config: ExperimentConfig, graph: Graph, log_dir: str | Path,
                 progress: Progress | None = None, shard: Shard | None = None, resume: int | None = None):
        self.config = config
        self.resume = resume
        self.graph = graph
        self.log_path = Path(log_dir) / COLUMNAR_LOG
        self.progress = progress
        self.shard = shard or Shard(0, 1, 0, config.nodes, config.nodes)
        self.stacked: StackedState | None = None  # after run(): the final state of this process's nodes
        self.step_time = 0.0

    def run(self) -> dict[int, dict[str, Any]]:
        """Train every node for the configured iterations; returns each node's final summary (in
        the first process; the others return none)."""
        keep_freed_memory()  # a step's large tensors reuse freed memory instead of faulting fresh pages in
        # this thread's tensor work on one intra-op thread too, as the workers': the run's parallelism
        # is theirs (a second intra-op thread here spun between small operations: 3.5 of 19 CPU s for
        # 1,024 MLP nodes, for half a second of wall-clock time; benchmarks/RESULTS.md)
        with intra_op_threads(1 if self.config.device == "cpu" else None):
            run = self._build()
            try:
                return self._train(run)
            finally:
                run.models.close()
                if run.log is not None:
                    run.log.close()

    def _train(self, run: "_Run") -> dict[int, dict[str, Any]]:
        """The run proper, once built: start event, iterations, final evaluation and summaries."""
        if self.resume is not None:
            self._restore(run)
        elif run.log is not None:
            bad = {rank: str(spec) for rank, spec in self.config.attackers().items()}
            run.log.write(columnar_event(
                "start", run.ranks, {"neighbours": [self.graph.neighbours(r) for r in run.ranks],
                                     "samples": run.samples, "byzantine": [bad.get(r) for r in run.ranks]},
                parameters=run.stacked.param_count, state_bytes=run.stacked.row_bytes,
                threads=torch.get_num_threads(), time=time.time(), engine="batched",
                vectorized=run.models.vectorized, step_time=self.step_time,
                step_cost="configured" if self.config.batched.step_time else self.config.batched.step_cost,
                processes=self.shard.count))
        if run.algorithm.asynchronous:
            driver = _Asynchronous(run, self.progress)
            run.algorithm.drive(driver)
            finish = driver.finish
            final = run.collective.gather(_evaluations(run, full=True))
        else:
            final = self._lockstep(run)  # its last evaluation is of the final models
            finish = run.clocks.now
        reports = run.algorithm.peers_report()
        peers = run.collective.gather([reports.get(rank - self.shard.start) for rank in self.shard.ranks])
        privacy = _privacy_columns(run)
        if run.log is None:
            return {}
        # the run's final model (node 0's, in the first process), as the process engine's node 0 keeps it
        save_weights(run.stacked.named(run.stacked.row(0), run.stacked.counters_of(0)),
                     self.log_path.parent.parent / MODEL_FILE, model_metadata(run.dataset))
        by_rank = dict(final)
        summaries = {rank: {"event": "final", "rank": rank, "elapsed": float(finish[rank]),
                            "stats": run.traffic.of(rank),
                            "metrics": None if rank not in by_rank else by_rank[rank].as_dict()}
                     for rank in run.ranks}
        run.log.write(columnar_event("final", run.ranks, {
            **privacy,
            "metrics": [summaries[r]["metrics"] for r in run.ranks],
            "stats": [summaries[r]["stats"] for r in run.ranks],
            "elapsed": [summaries[r]["elapsed"] for r in run.ranks],
            **({"peers": peers} if any(peers) else {})}, clock="modelled", workers=run.models.choice.chosen))
        return summaries

    def _build(self) -> "_Run":
        """Everything the run needs: data, the nodes' state and models, links, clocks, algorithm."""
        config, graph, shard = self.config, self.graph, self.shard
        collective = Collective(shard)
        if config.models_module:
            load_user_module(config.models_module)
        dataset, validation = split_validation(load_run_dataset(config), config.validation, config.seed)
        parts = partition_dataset(dataset, config.nodes, config.partition, config.seed)
        device = torch.device(config.device)
        torch.manual_seed(config.seed)  # every node starts from this one model, as in the process engine
        model = build_model(config.model, dataset.input_shape, dataset.num_classes).to(device)
        self.step_time = collective.broadcast(
            modelled_step_time(model, dataset, parts[0], config) if shard.main else 0.0)
        stacked = self.stacked = StackedState(model, shard.size, device)
        vectorized = vectorize(config, model)
        chunk = training_chunk(config, model, dataset.normalize(dataset.train_x[:1])[0]) if vectorized else 0
        steps = config.rounds * (_batches_per_epoch(parts, config.batch_size) if config.full_epochs else 1)
        privacy = Privacy.of(config, PrivateNodes(tuple(range(shard.start, shard.stop)),
                                                  tuple(len(part) for part in parts[shard.start:shard.stop]), steps,
                                                  str(device), stacked.param_count))
        models = NodeModels(stacked, vectorized, chunk, *worker_counts(config),
                            loss_of=task_of(dataset).loss, clip=privacy.clip_norm)
        links = Links.of(graph, device)
        sender, receiver = links.sender.cpu().numpy(), links.receiver.cpu().numpy()
        plan, local = None, links
        if shard.count > 1:
            plan = halo_plan(sender, receiver, shard, device)
            local = links.local(shard.start, shard.stop, plan.extended_index(shard))
        message_bytes = stacked.row_bytes if config.sharing == "full" else \
            make_sharing(config.sharing, stacked.state.shape[1], stacked.state.dtype, config.seed,
                         lossy=config.transport == "udp").wire_bytes()
        clocks = VirtualClocks(config, self.step_time, message_bytes, sender, receiver)
        traffic = Traffic(config.nodes)
        if shard.count > 1:
            refuse_torchrun(config)
        algorithm = make_batched_algorithm(config.algorithm, BatchedContext(
            config, graph, stacked, links, clocks, shard, local, collective, plan, [len(part) for part in parts],
            ModelledNetwork(config, clocks, traffic)), traffic)
        optimizer = make_optimizer(config.optimizer, stacked.params, config.lr, config.momentum, config.weight_decay)
        outer = config.outer.begin(stacked.params) if config.outer.active and not algorithm.asynchronous else None
        if not privacy.changes_steps:  # a privacy mechanism's step needs the gradients
            models.fuse(optimizer)  # plain SGD steps in the workers, right after each block's gradients
        return _Run(
            config=config, shard=shard, collective=collective, dataset=dataset, validation=validation,
            shards=parts[shard.start:shard.stop], stacked=stacked,
            models=models,
            sgd=optimizer,
            batches=NodeBatches(dataset, parts[shard.start:shard.stop], config.batch_size,
                                secret_seed() if secret_batches(config) else config.seed, device,
                                first_rank=shard.start, flipped=flipped_labels(config, shard.start, shard.stop)),
            clocks=clocks, traffic=traffic, algorithm=algorithm, ranks=list(range(config.nodes)),
            evaluating=[rank for rank in shard.ranks if config.node_evaluates(rank)],
            samples=[len(part) for part in parts], outer=outer,
            log=JsonlLog(self.log_path, append=self.resume is not None) if shard.main else None,
            steps=steps, privacy=privacy,
            skips_idle=steps_rows_apart(config.optimizer))

    def _lockstep(self, run: "_Run") -> list[tuple[int, Evaluation]]:
        """Every node takes each iteration's steps together, then the algorithm exchanges; returns
        the evaluation of the final models (every metric: the last iteration's, not a second pass)."""
        steps = _Lockstep(run, self._checkpoints(run), self)
        drive(steps, run.config, run.first)
        return steps.evaluation

    def _checkpoints(self, run: "_Run") -> RunCheckpoints | None:
        """Where this run keeps its checkpoints: none for an asynchronous algorithm, under
        torchrun (each process would hold a block), or with ``checkpoint_every: 0``."""
        config = run.config
        if run.algorithm.asynchronous or self.shard.count > 1 or not config.checkpoint_interval:
            return None
        return RunCheckpoints(self.log_path.parent.parent, "nodes", config.fingerprint(), config.checkpoint_keep)

    def parts_of(self, run: "_Run") -> dict[str, Any]:
        """What a checkpoint keeps: every part of the run that changes as it trains."""
        parts = {"stacked": run.stacked, "sgd": run.sgd, "loaders": run.batches.loaders, "clocks": run.clocks,
                 "traffic": run.traffic, "network": run.algorithm.ctx.network, "algorithm": run.algorithm,
                 "outer": run.outer, "torch_rng": torch.get_rng_state()}
        if run.stacked.state.device.type == "cuda":
            parts["cuda_rng"] = torch.cuda.get_rng_state(run.stacked.state.device)
        return parts

    def _restore(self, run: "_Run") -> None:
        """Continue from the checkpoint of ``resume`` iterations: every part as it was, the log cut
        back to it (``restore_run``)."""
        checkpoints = self._checkpoints(run)
        if checkpoints is None:
            raise CheckpointError(f"a batched {run.config.algorithm} run keeps no checkpoints (asynchronous, "
                                  "under torchrun, or checkpoint_every 0): it cannot be resumed; run it again")
        meta, _, _ = restore_run(checkpoints, self.resume, self.parts_of(run), run.stacked.state.device, run.privacy,
                                 self.log_path if run.log is not None else None)
        run.first = self.resume
        self.step_time = float(meta.get("step_time", self.step_time))  # a measured one: the run's first measure
        run.began = time.perf_counter() - float(meta.get("wall", 0.0))
        if run.log is not None:
            run.log.write(columnar_event("resumed", run.ranks, {}, iteration=self.resume, time=time.time()))


def _privacy_columns(run: _Run) -> dict[str, list]:
    """Each node's privacy report (``Privacy.report``: DP-SGD's epsilon) as the final event's columns,
    gathered from every process."""
    reports = [run.privacy.report(row) for row in range(run.shard.size)]
    return {key: run.collective.gather([report[key] for report in reports]) for key in (reports[0] if reports else {})}


class _Lockstep(IterationSteps):
    """The batched engine's part of each iteration (``iterations.drive``) for every node at once:
    ``checkpoints`` where the run keeps them (None: never); ``evaluation`` the latest iteration's."""

    def __init__(self, run: "_Run", checkpoints: RunCheckpoints | None, simulation: "BatchedSimulation"):
        self.run, self.checkpoints, self.simulation = run, checkpoints, simulation
        self.evaluation: list[tuple[int, Evaluation]] | None = None

    def set_lr(self, lr: float) -> None:
        self.run.sgd.set_lr(lr)

    def begin(self, iteration: int) -> None:
        self.run.algorithm.before_local_steps(iteration)

    def train(self, iteration: int) -> tuple[list, np.ndarray]:
        """(each node's losses of the iteration's steps, their modelled compute time; the clocks
        advanced by it)."""
        run, trainers = self.run, self._trainers(iteration)
        losses = run.train(trainers)
        return losses, run.clocks.train(run.steps, None if trainers is None else
                                        [run.shard.start + r for r in trainers])

    def _trainers(self, iteration: int) -> list[int] | None:
        """The nodes that take ``iteration``'s steps: those asked for them, where the optimizer
        allows the others to skip them (None: every node)."""
        return self.run.algorithm.trainers(iteration) if self.run.skips_idle else None

    def exchange(self, iteration: int, trained: tuple[list, np.ndarray]) -> tuple[list, dict]:
        (losses, compute), nodes = trained, self.run.config.nodes
        columns = {"train": compute, "encode": np.zeros(nodes), "average": np.zeros(nodes),
                   **self.run.algorithm.after_local_steps(iteration)}
        return losses, columns

    def outer_step(self, iteration: int) -> None:
        run = self.run  # the exchange's result is an aggregate: the outer optimizer's step, every node's
        run.config.outer.step(run.stacked.params, run.outer, run.algorithm.aggregated(iteration))

    def finish(self, iteration: int, record: tuple[list, dict], evaluate: bool, full: bool = False) -> None:
        run, (losses, columns) = self.run, record
        collective = run.collective
        train_loss = collective.gather(losses)
        columns["t"] = run.clocks.now
        done = iteration + 1
        evaluation = consensus = validation = on_shards = None
        if evaluate:
            evaluation, validation, on_shards = _evaluated(run, full, gather=collective.gather)
            consensus = consensus_distance(collective.sum_(run.stacked.consensus_sums()))
        self.evaluation = evaluation
        if run.log is not None:
            columns["train_loss"] = train_loss
            run.write_iteration(iteration, _lists(columns))
            if evaluation:
                run.write_evaluation(done, evaluation, run.clocks.now, consensus, validation, on_shards)
        if self.simulation.progress is not None:
            self.simulation.progress(done)

    def save(self, done: int) -> None:
        if self.checkpoints is not None:
            self.checkpoints.save(done, self.simulation.parts_of(self.run), wall=time.perf_counter() - self.run.began,
                                  engine="batched", step_time=self.simulation.step_time)


@dataclass
class _Run:
    """The parts of one run of the batched engine (what ``BatchedSimulation._build`` made)."""

    config: ExperimentConfig
    shard: Shard
    collective: Collective
    dataset: Dataset
    validation: Dataset | None
    shards: list[np.ndarray]  # this process's nodes' training samples
    stacked: StackedState
    models: NodeModels
    sgd: Any  # StackedSGD, or a torch.optim optimizer over the rows (optim.make_optimizer)
    batches: NodeBatches
    clocks: VirtualClocks
    traffic: Traffic
    algorithm: BatchedAlgorithm
    ranks: list[int]
    evaluating: list[int]
    samples: list[int]
    log: JsonlLog | None
    outer: Any = None  # the outer optimizer's state (a lockstep run's)
    first: int = 0  # the first iteration to run (a resumed run's checkpoint)
    began: float = field(default_factory=time.perf_counter)
    steps: int = 1  # local steps per iteration: rounds, or rounds x the shards' batches (full_epochs)
    skips_idle: bool = True  # nodes an iteration does not ask to train skip it (steps_rows_apart)
    privacy: Privacy = field(default_factory=Privacy)  # the active privacy mechanisms (DP-SGD's noise)

    def train(self, rows: list[int] | None = None) -> list[float | None]:
        """This iteration's local steps of every node of the block (or of ``rows`` only: the others
        draw no batch and take no step); each node's mean loss (None for an idle one)."""
        losses = torch.zeros(self.shard.size, dtype=torch.float64)
        for _ in range(self.steps if rows is None or rows else 0):
            ranks, loss = self.step(rows)
            losses[ranks.cpu()] += loss.double().cpu()
        trained = set(range(self.shard.size) if rows is None else rows)
        means = (losses / max(1, self.steps)).tolist()
        return [means[r] if self.steps and r in trained else None for r in range(self.shard.size)]

    def step(self, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One local step of the block's nodes (or of ``rows`` only): their batches, gradients and
        the optimizer's update (taken in the workers where it is fused: ``NodeModels.fuse``); the
        ranks that stepped and their losses."""
        ranks, grads, loss = self.models.gradients(self.batches.next(rows))
        self.privacy.local_step(ranks, grads)  # the privacy mechanisms' step (DP-SGD: the clipped sums noised)
        if grads is not None:
            every = len(ranks) == self.shard.size
            if every and not bool((ranks == torch.arange(len(ranks), device=ranks.device)).all()):
                grads = grads[torch.argsort(ranks)]  # in rank order (batches of two sizes), for an optimizer
                # that steps every row together
            self.sgd.step(grads, None if every else ranks)
        return ranks, loss

    def evaluates_after(self, done: int) -> bool:
        """Whether the nodes are evaluated once ``done`` iterations are done."""
        return evaluation_due(done, self.config)

    def write_iteration(self, iteration: int, columns: dict[str, list]) -> None:
        if self.shard.count == 1:  # each process counts its own nodes' traffic
            columns = {**columns, "bytes_sent": self.traffic.counters["bytes_sent"].tolist()}
        self.log.write(columnar_event("iteration", self.ranks, columns, iteration=iteration,
                                      wall=time.perf_counter() - self.began))  # real seconds, for benchmarks

    def write_evaluation(self, done: int, evaluation: list[tuple[int, Evaluation]], times, consensus: float,
                         validation: list[tuple[int, Evaluation]] | None = None,
                         on_shards: list[tuple[int, Evaluation]] | None = None) -> None:
        tested = [rank for rank, _ in evaluation]
        fields = [evaluation_fields(test, *(None if more is None else more[k][1] for more in (validation, on_shards)))
                  for k, (_, test) in enumerate(evaluation)]
        columns = {"t": [float(times[r]) for r in tested],
                   **{name: [node[name] for node in fields] for name in (fields[0] if fields else ())}}
        if self.shard.count == 1:  # as write_iteration: each process counts its own nodes' traffic
            columns["bytes_sent"] = [int(self.traffic.counters["bytes_sent"][r]) for r in tested]
        self.log.write(columnar_event("eval", tested, columns, iteration=done, consensus=consensus))


class _Asynchronous:
    """The engine's side of an asynchronous algorithm (``AsyncDriver``): trains the nodes it is
    given, and logs each iteration once every node has finished it (nodes finish an iteration at
    different modelled times), evaluating the models each node had when it finished it."""

    def __init__(self, run: _Run, progress: Progress | None):
        self.run = run
        self.progress = progress
        self.records: dict[int, dict[int, dict[str, Any]]] = {}  # iteration -> rank -> its columns
        self.snapshots: dict[int, torch.Tensor] = {}  # iteration -> every node's state when it finished it
        self.finish = np.zeros(run.config.nodes)
        self.written = 0  # iterations logged so far
        outer = run.config.outer
        self.outer = outer.begin(run.stacked.params) if outer.active else None  # every node's, stepped one by one

    def train(self, ranks: list[int]) -> dict[int, float]:
        run = self.run
        index, losses = run.step(ranks)
        return {rank: float(loss) for rank, loss in zip(index.tolist(), losses.tolist())}

    def record(self, rank: int, iteration: int, now: float, columns: dict[str, Any]) -> None:
        run = self.run
        if self.outer is not None:  # the node's model after the iteration's steps and exchanges: its outer step
            run.config.outer.step(run.stacked.params[rank:rank + 1],
                                  {name: rows[rank:rank + 1] for name, rows in self.outer.items()})
        self.records.setdefault(iteration, {})[rank] = {**columns, "t": now}
        if run.evaluates_after(iteration + 1):
            rows = self.snapshots.setdefault(iteration, torch.empty_like(run.stacked.state))
            rows[rank] = run.stacked.state[rank]
        while len(self.records.get(self.written, ())) == run.config.nodes:
            self._write(self.written)
            self.written += 1

    def finished(self, rank: int, now: float) -> None:
        self.finish[rank] = now

    def _write(self, iteration: int) -> None:
        run = self.run
        records = self.records.pop(iteration)
        names = list(dict.fromkeys(name for record in records.values() for name in record))
        columns = {name: [records[rank].get(name) for rank in run.ranks] for name in names}
        done = iteration + 1
        if run.log is not None:
            run.write_iteration(iteration, columns)
        rows = self.snapshots.pop(iteration, None)
        if rows is not None:
            evaluation, validation, on_shards = _evaluated(run, rows=rows)
            consensus = consensus_distance(run.stacked.consensus_sums(rows))
            if run.log is not None:
                run.write_evaluation(done, evaluation, columns["t"], consensus, validation, on_shards)
        if self.progress is not None:
            self.progress(done)


def _evaluated(run: _Run, full: bool = False, rows: torch.Tensor | None = None,
               gather: Callable[[list], list] = lambda results: results) -> tuple[list, list | None, list | None]:
    """What an eval event holds of this process's evaluating nodes, of their current models or of
    ``rows``: their test evaluations (every metric where ``full``) and ``more_evaluations``, each
    list through ``gather`` (every process's, under torchrun)."""
    return gather(_evaluations(run, full=full, rows=rows)), *more_evaluations(
        run.config, run.validation, lambda: gather(_evaluations(run, rows=rows, on=run.validation)),
        lambda: gather(_shard_evaluations(run, rows)))


def _shard_evaluations(run: _Run, rows: torch.Tensor | None = None) -> list[tuple[int, Evaluation]]:
    """(rank, evaluation) of this process's evaluating nodes over their own training shards (one
    node at a time: each has its own data), of their current models or of ``rows``."""
    first, out = run.shard.start, []
    for rank in run.evaluating:
        local = rank - first
        own = shard_as_test_set(run.dataset, run.shards[local])
        chosen = None if rows is None else rows[local:local + 1]
        out.append((rank, evaluate_nodes(run.models, [local], own, 0, False, chosen)[local]))
    return out


def _batches_per_epoch(parts: list[np.ndarray], batch_size: int) -> int:
    """The mini-batches in one pass over a shard, the same for every node; ConfigError if not
    (every node of the batched engine takes its steps with all the others)."""
    counts = sorted({-(-len(part) // min(batch_size, len(part))) for part in parts})
    if len(counts) > 1:
        raise ConfigError(f"full_epochs on the batched engine needs every shard to make as many batches of "
                          f"{batch_size}; these make {counts[0]} to {counts[-1]}: use the process engine, or a batch "
                          "size that divides the shards alike")
    return counts[0]


def _evaluations(run: _Run, full: bool = False, rows: torch.Tensor | None = None,
                 on: Dataset | None = None) -> list[tuple[int, Evaluation]]:
    """(rank, evaluation) of this process's evaluating nodes, of their current models or of
    ``rows`` (a snapshot of this process's rows)."""
    first = run.shard.start
    local = [rank - first for rank in run.evaluating]
    chosen = None if rows is None else rows[torch.tensor(local, dtype=torch.int64, device=rows.device)]
    results = evaluate_nodes(run.models, local, on or run.dataset, run.config.eval_samples, full, chosen)
    return [(rank, results[rank - first]) for rank in run.evaluating]


def _lists(columns: dict[str, Any]) -> dict[str, list]:
    """Columns as JSON-ready lists (numpy and torch values to Python numbers)."""
    out = {}
    for name, values in columns.items():
        if isinstance(values, (np.ndarray, torch.Tensor)):
            values = values.tolist()
        out[name] = list(values)
    return out


def refuse_torchrun(config: ExperimentConfig) -> None:
    """ConfigError, in one line, if this run cannot be split over torchrun processes: its
    algorithm's declaration says it runs in one process, or its peers change every round or it
    shares parts of models (both are exchanged in one process only)."""
    for lacks, what in ((not definition(config.algorithm).needs.torchrun, config.algorithm),
                        (bool(config.dynamic()), config.dynamic()),
                        (config.sharing != "full", f"sharing {config.sharing}")):
        if lacks:
            raise ConfigError(f"{what} runs in one process of the batched engine, not under torchrun: start it "
                              "without torchrun")
