"""A batched run's parts (``Run``: data, rows, models, optimizer, batches, clocks, algorithm, log) and
its steps of each lockstep iteration (``Lockstep``, what ``iterations.drive`` calls), with the
evaluations and log events they write; the engine builds a run and drives it (``engine``), the
cohort path builds its own (``cohortrun``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from meshlearn.batched.algorithms import (
    BatchedAlgorithm,
    Traffic,
)
from meshlearn.batched.batches import NodeBatches
from meshlearn.batched.clock import VirtualClocks
from meshlearn.batched.evaluate import evaluate_nodes
from meshlearn.batched.models import NodeModels
from meshlearn.batched.shards import Collective, Shard
from meshlearn.batched.stacked import StackedState, average_row, consensus_distance
from meshlearn.checkpoint import RunCheckpoints
from meshlearn.config import ExperimentConfig
from meshlearn.data import (
    Dataset,
    shard_as_test_set,
)
from meshlearn.iterations import (
    IterationSteps,
    evaluation_due,
    evaluation_fields,
    more_evaluations,
)
from meshlearn.metrics import Evaluation
from meshlearn.privacy.mechanism import Privacy
from meshlearn.runlog import JsonlLog, columnar_event


class Lockstep(IterationSteps):
    """The batched engine's part of each iteration (``iterations.drive``) for every node at once:
    ``checkpoints`` where the run keeps them (None: never); ``evaluation`` the latest iteration's;
    ``simulation``: the ``engine.BatchedSimulation`` it reports progress to and saves the parts of."""

    def __init__(self, run: "Run", checkpoints: RunCheckpoints | None, simulation: Any):
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
        run.config.outer.step(run.stacked.params[run.outer_rows], run.outer, run.algorithm.aggregated(iteration))

    def logged(self) -> list[int] | None:
        """The ranks an iteration's log event names (None: every node)."""
        return None

    def finish(self, iteration: int, record: tuple[list, dict], evaluate: bool, full: bool = False) -> None:
        run, (losses, columns) = self.run, record
        collective, ranks = run.collective, self.logged()
        train_loss = collective.gather(losses)
        columns["t"] = run.clocks.now if ranks is None else run.clocks.now[ranks]
        done = iteration + 1
        evaluation = consensus = validation = on_shards = average = None
        if evaluate:
            evaluation, validation, on_shards = evaluated(run, full, gather=collective.gather)
            consensus, average = run.consensus(), run.average_evaluation()
        self.evaluation = evaluation
        if run.log is not None:
            columns["train_loss"] = train_loss
            run.write_iteration(iteration, as_lists(columns), ranks)
            if evaluation:
                run.write_evaluation(done, evaluation, run.clocks.now, consensus, validation, on_shards, average)
        if self.simulation.progress is not None:
            self.simulation.progress(done)

    def save(self, done: int) -> None:
        if self.checkpoints is not None:
            self.checkpoints.save(done, self.simulation.parts_of(self.run), wall=time.perf_counter() - self.run.began,
                                  engine="batched", step_time=self.simulation.step_time)


@dataclass
class Run:
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
    lockstep: type = None  # the iteration steps' class (``Lockstep``; the cohort path's own)
    outer_rows: slice = field(default_factory=lambda: slice(None))  # the rows an outer optimizer steps (every node's; the server's alone)

    def __post_init__(self) -> None:
        self.lockstep = self.lockstep or Lockstep

    def close(self) -> None:
        """Stop the workers and close the log (the run is over, or failed)."""
        self.models.close()
        if self.log is not None:
            self.log.close()

    def started_ranks(self) -> list[int]:
        """The ranks the start event names: every node."""
        return self.ranks

    def population_fields(self) -> dict[str, Any]:
        """What the start event says of a population beyond its nodes' rows: nothing here."""
        return {}

    def final_ranks(self) -> list[int]:
        """The ranks the final event names: every node."""
        return self.ranks

    def consensus(self) -> float:
        """The consensus distance of the nodes' models now (every process's)."""
        return consensus_distance(self.collective.sum_(self.stacked.consensus_sums()))

    def average_evaluation(self, rows: torch.Tensor | None = None) -> Evaluation | None:
        """The honest nodes' average model (every process's nodes; of ``rows``, a snapshot of this
        process's, where given) on the test set, as each node's is evaluated: the model the nodes
        agree on once they stop training and only average, which papers on decentralized training
        report beside the nodes' own. None in the processes that do not log (torchrun's others)."""
        bad = self.config.attackers()
        leave_out = [rank - self.shard.start for rank in self.shard.ranks if rank in bad]
        sums = self.collective.sum_(self.stacked.state_sums(rows, leave_out))
        if self.log is None:
            return None
        average = average_row(sums, self.stacked.state.dtype)
        return evaluate_nodes(self.models, [0], self.dataset, self.config.eval_samples, False, average)[0]

    def train(self, rows: list[int] | None = None) -> list[float | None]:
        """This iteration's local steps of every node of the block (or of ``rows`` only: the others
        draw no batch and take no step); each node's mean loss (None for an idle one)."""
        count = self.stacked.nodes
        losses = torch.zeros(count, dtype=torch.float64)
        for _ in range(self.steps if rows is None or rows else 0):
            ranks, loss = self.step(rows)
            losses[ranks.cpu()] += loss.double().cpu()
        trained = set(range(count) if rows is None else rows)
        means = (losses / max(1, self.steps)).tolist()
        return [means[r] if self.steps and r in trained else None for r in range(count)]

    def step(self, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One local step of the block's nodes (or of ``rows`` only): their batches, gradients and
        the optimizer's update (taken in the workers where it is fused: ``NodeModels.fuse``); the
        ranks that stepped and their losses."""
        ranks, grads, loss = self.models.gradients(self.batches.next(rows))
        self.privacy.local_step(ranks, grads)  # the privacy mechanisms' step (DP-SGD: the clipped sums noised)
        if grads is not None:
            every = len(ranks) == self.stacked.nodes
            if every and not bool((ranks == torch.arange(len(ranks), device=ranks.device)).all()):
                grads = grads[torch.argsort(ranks)]  # in rank order (batches of two sizes), for an optimizer
                # that steps every row together
            self.sgd.step(grads, None if every else ranks)
        return ranks, loss

    def evaluates_after(self, done: int) -> bool:
        """Whether the nodes are evaluated once ``done`` iterations are done."""
        return evaluation_due(done, self.config)

    def write_iteration(self, iteration: int, columns: dict[str, list], ranks: list[int] | None = None) -> None:
        """The iteration's event: ``columns`` of every node (or of ``ranks``)."""
        sent = self.traffic.counters["bytes_sent"]
        if self.shard.count == 1:  # each process counts its own nodes' traffic
            columns = {**columns, "bytes_sent": (sent if ranks is None else sent[ranks]).tolist()}
        self.log.write(columnar_event("iteration", self.ranks if ranks is None else ranks, columns, iteration=iteration,
                                      wall=time.perf_counter() - self.began))  # real seconds, for benchmarks

    def write_evaluation(self, done: int, evaluation: list[tuple[int, Evaluation]], times, consensus: float,
                         validation: list[tuple[int, Evaluation]] | None = None,
                         on_shards: list[tuple[int, Evaluation]] | None = None,
                         average: Evaluation | None = None) -> None:
        """The evaluation's event: each node's fields (``evaluation_fields``), the ``consensus``
        distance and, where evaluated, the average model's (``average_acc``, ``average_loss``, a
        language model's ``average_perplexity``)."""
        tested = [rank for rank, _ in evaluation]
        fields = [evaluation_fields(test, *(None if more is None else more[k][1] for more in (validation, on_shards)))
                  for k, (_, test) in enumerate(evaluation)]
        columns = {"t": [float(times[r]) for r in tested],
                   **{name: [node[name] for node in fields] for name in (fields[0] if fields else ())}}
        if self.shard.count == 1:  # as write_iteration: each process counts its own nodes' traffic
            columns["bytes_sent"] = [int(self.traffic.counters["bytes_sent"][r]) for r in tested]
        averaged = {} if average is None else {"average_" + name.removeprefix("test_"): value
                                               for name, value in evaluation_fields(average).items()}
        self.log.write(columnar_event("eval", tested, columns, iteration=done, consensus=consensus, **averaged))


def evaluated(run: Run, full: bool = False, rows: torch.Tensor | None = None,
               gather: Callable[[list], list] = lambda results: results) -> tuple[list, list | None, list | None]:
    """What an eval event holds of this process's evaluating nodes, of their current models or of
    ``rows``: their test evaluations (every metric where ``full``) and ``more_evaluations``, each
    list through ``gather`` (every process's, under torchrun)."""
    return gather(evaluations(run, full=full, rows=rows)), *more_evaluations(
        run.config, run.validation, lambda: gather(evaluations(run, rows=rows, on=run.validation)),
        lambda: gather(shardevaluations(run, rows)))


def shardevaluations(run: Run, rows: torch.Tensor | None = None) -> list[tuple[int, Evaluation]]:
    """(rank, evaluation) of this process's evaluating nodes over their own training shards (one
    node at a time: each has its own data), of their current models or of ``rows``."""
    first, out = run.shard.start, []
    for rank in run.evaluating:
        local = rank - first
        own = shard_as_test_set(run.dataset, run.shards[local])
        chosen = None if rows is None else rows[local:local + 1]
        out.append((rank, evaluate_nodes(run.models, [local], own, 0, False, chosen)[local]))
    return out


def evaluations(run: Run, full: bool = False, rows: torch.Tensor | None = None,
                 on: Dataset | None = None) -> list[tuple[int, Evaluation]]:
    """(rank, evaluation) of this process's evaluating nodes, of their current models or of
    ``rows`` (a snapshot of this process's rows)."""
    first = run.shard.start
    local = [rank - first for rank in run.evaluating]
    chosen = None if rows is None else rows[torch.tensor(local, dtype=torch.int64, device=rows.device)]
    results = evaluate_nodes(run.models, local, on or run.dataset, run.config.eval_samples, full, chosen)
    return [(rank, results[rank - first]) for rank in run.evaluating]


def as_lists(columns: dict[str, Any]) -> dict[str, list]:
    """Columns as JSON-ready lists (numpy and torch values to Python numbers)."""
    out = {}
    for name, values in columns.items():
        if isinstance(values, (np.ndarray, torch.Tensor)):
            values = values.tolist()
        out[name] = list(values)
    return out
