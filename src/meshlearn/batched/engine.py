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

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from meshlearn.batched.algorithms import (
    BatchedContext,
    Traffic,
    make_batched_algorithm,
)
from meshlearn.batched.batches import NodeBatches
from meshlearn.batched.byzantine import flipped_labels
from meshlearn.batched.clock import VirtualClocks
from meshlearn.batched.cohort import cohort_refusal
from meshlearn.batched.cohortrun import build_cohort_run
from meshlearn.batched.lockstep import Run, evaluated, evaluations
from meshlearn.batched.memory import keep_freed_memory, release_freed_memory
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
from meshlearn.batched.shards import Collective, Shard, halo_plan
from meshlearn.batched.stacked import StackedState, consensus_distance
from meshlearn.batched.workers import intra_op_threads
from meshlearn.checkpoint import RunCheckpoints
from meshlearn.config import ExperimentConfig
from meshlearn.data import (
    partition_dataset,
)
from meshlearn.data.vocabulary import model_metadata
from meshlearn.definitions.base import definition
from meshlearn.errors import CheckpointError, ConfigError
from meshlearn.iterations import (
    drive,
    restore_run,
)
from meshlearn.metrics import Evaluation
from meshlearn.models import MODEL_FILE, build_model, save_weights
from meshlearn.optim import optimizer_of, steps_rows_apart
from meshlearn.privacy.dpsgd import secret_seed
from meshlearn.privacy.mechanism import Privacy, PrivateNodes, secret_batches
from meshlearn.runlog import COLUMNAR_LOG, JsonlLog, columnar_event
from meshlearn.sharing import make_sharing
from meshlearn.tasks import task_of
from meshlearn.topology import Graph

Progress = Callable[[int], None]


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
                run.close()
                del run
                release_freed_memory()

    def _train(self, run: "Run") -> dict[int, dict[str, Any]]:
        """The run proper, once built: start event, iterations, final evaluation and summaries."""
        if self.resume is not None:
            self._restore(run)
        elif run.log is not None:
            bad = {rank: str(spec) for rank, spec in self.config.attackers().items()}
            started = run.started_ranks()
            run.log.write(columnar_event(
                "start", started, {"neighbours": [self.graph.neighbours(r) for r in started],
                                   "samples": [int(run.samples[r]) for r in started],
                                   "byzantine": [bad.get(r) for r in started]},
                **run.population_fields(),
                parameters=run.stacked.param_count, state_bytes=run.stacked.row_bytes,
                threads=torch.get_num_threads(), time=time.time(), engine="batched",
                vectorized=run.models.vectorized, step_time=self.step_time,
                step_cost="configured" if self.config.batched.step_time else self.config.batched.step_cost,
                processes=self.shard.count))
        if run.algorithm.asynchronous:
            driver = _Asynchronous(run, self.progress)
            run.algorithm.drive(driver)
            finish = driver.finish
            final = run.collective.gather(evaluations(run, full=True))
        else:
            final = self._lockstep(run)  # its last evaluation is of the final models
            finish = run.clocks.now
        reports = run.algorithm.peers_report()
        peers = run.collective.gather([reports.get(rank - self.shard.start) for rank in self.shard.ranks]) \
            if reports else []
        privacy = _privacy_columns(run)
        run.ranks = run.final_ranks()
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

    def _build(self) -> "Run":
        """Everything the run needs: data, the nodes' state and models, links, clocks, algorithm (on
        the cohort path, ``cohortrun``, where the run can take it)."""
        if cohort_refusal(self.config, self.shard.count) is None:
            return build_cohort_run(self)
        config, graph, shard = self.config, self.graph, self.shard
        collective = Collective(shard)
        dataset, validation = run_data(config)
        parts = partition_dataset(dataset, config.nodes, config.partition, config.seed)
        device = torch.device(config.device)
        torch.manual_seed(config.seed)  # every node starts from this one model, as in the process engine
        model = build_model(config.model, dataset.input_shape, dataset.num_classes).to(device)
        self.step_time = collective.broadcast(
            modelled_step_time(model, dataset, parts[0], config) if shard.main else 0.0)
        if device.type == "cpu":
            refuse_rows_beyond_memory(config, model, shard.size)
        stacked = self.stacked = StackedState(model, shard.size, device)
        vectorized = vectorize(config, model)
        chunk = training_chunk(config, model, dataset.normalize(dataset.train_x[:1])[0]) if vectorized else 0
        steps = config.rounds * (batches_per_epoch([len(part) for part in parts], config.batch_size)
                                 if config.full_epochs else 1)
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
        optimizer = algorithm.local_optimizer(optimizer_of(config, stacked.params))  # a stand-in where it steps itself
        outer = config.outer.begin(stacked.params) if config.outer.active and not algorithm.asynchronous else None
        if not privacy.changes_steps:  # a privacy mechanism's step needs the gradients
            models.fuse(optimizer)  # plain SGD steps in the workers, right after each block's gradients
        return Run(
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

    def _lockstep(self, run: "Run") -> list[tuple[int, Evaluation]]:
        """Every node takes each iteration's steps together, then the algorithm exchanges; returns
        the evaluation of the final models (every metric: the last iteration's, not a second pass)."""
        steps = run.lockstep(run, self._checkpoints(run), self)
        drive(steps, run.config, run.first)
        return steps.evaluation

    def _checkpoints(self, run: "Run") -> RunCheckpoints | None:
        """Where this run keeps its checkpoints: none for an asynchronous algorithm, under
        torchrun (each process would hold a block), or with ``checkpoint_every: 0``."""
        config = run.config
        if run.algorithm.asynchronous or self.shard.count > 1 or not config.checkpoint_interval:
            return None
        return RunCheckpoints(self.log_path.parent.parent, "nodes", config.fingerprint(), config.checkpoint_keep)

    def parts_of(self, run: "Run") -> dict[str, Any]:
        """What a checkpoint keeps: every part of the run that changes as it trains."""
        parts = {"stacked": run.stacked, "sgd": run.sgd, "loaders": run.batches.checkpointed, "clocks": run.clocks,
                 "traffic": run.traffic, "network": run.algorithm.ctx.network, "algorithm": run.algorithm,
                 "outer": run.outer, "torch_rng": torch.get_rng_state()}
        if run.stacked.state.device.type == "cuda":
            parts["cuda_rng"] = torch.cuda.get_rng_state(run.stacked.state.device)
        return parts

    def _restore(self, run: "Run") -> None:
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


def _privacy_columns(run: Run) -> dict[str, list]:
    """Each node's privacy report (``Privacy.report``: DP-SGD's epsilon) as the final event's columns,
    gathered from every process."""
    reports = [run.privacy.report(row) for row in range(run.shard.size)]
    return {key: run.collective.gather([report[key] for report in reports]) for key in (reports[0] if reports else {})}


class _Asynchronous:
    """The engine's side of an asynchronous algorithm (``AsyncDriver``): trains the nodes it is
    given, and logs each iteration once every node has finished it (nodes finish an iteration at
    different modelled times), evaluating the models each node had when it finished it."""

    def __init__(self, run: Run, progress: Progress | None):
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
            evaluation, validation, on_shards = evaluated(run, rows=rows)
            consensus, average = consensus_distance(run.stacked.consensus_sums(rows)), run.average_evaluation(rows)
            if run.log is not None:
                run.write_evaluation(done, evaluation, columns["t"], consensus, validation, on_shards, average)
        if self.progress is not None:
            self.progress(done)


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


ROW_COPIES = 2  # [N, P] tensors a run holds at least: the rows, and one more (a payload, gradients or moments)


def refuse_rows_beyond_memory(config: ExperimentConfig, model: nn.Module, rows: int,
                              available: int | None = None) -> None:
    """ConfigError, in one line, before anything is allocated, where a row per node cannot fit in the
    memory this machine has free (``available`` bytes; default: the kernel's MemAvailable): say why
    the run cannot take the cohort path, and what to change (a run of 20,000 clients was killed by
    the kernel at 24 GB, taking the machine's memory with it)."""
    from meshlearn.batched.cohort import cohort_refusal

    row = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.is_floating_point())
    needed = ROW_COPIES * rows * row
    free = available if available is not None else memory_available()
    if free is None or needed <= free:
        return
    why = cohort_refusal(config)
    path = f"it keeps a row per node because {why}" if why else "it keeps a row per node"
    raise ConfigError(f"{rows:,} nodes of {row / 1e6:.2f} MB each need at least {needed / 1e9:.1f} GB on the "
                      f"batched engine, more than the {free / 1e9:.1f} GB free here: {path}; use fewer nodes, or "
                      "FedAvg with fedavg_cohort and what the cohort path models (docs/batched-engine.md)")


def memory_available() -> int | None:
    """Bytes of memory the kernel says are available (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
