"""The node runtime: local training, the algorithm's exchange, evaluation and the run log."""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from meshlearn.attacks.forge import LabelFlip, make_attack
from meshlearn.checkpoint import RunCheckpoints
from meshlearn.config import ExperimentConfig
from meshlearn.data import Dataset, ShardLoader, loader_seed, shard_as_test_set, split_validation
from meshlearn.evaluation import evaluate_model
from meshlearn.flat import FlatState
from meshlearn.iterations import drive, more_evaluations, restore_run
from meshlearn.metrics import Evaluation
from meshlearn.node.algorithms import Algorithm, AlgorithmContext, make_algorithm
from meshlearn.node.iterations import NodeIterations
from meshlearn.optim import optimizer_of, steps_rows_apart
from meshlearn.privacy.dpsgd import PrivateGradients, clipped_gradient, secret_seed
from meshlearn.privacy.mechanism import Privacy, PrivateNodes, secret_batches
from meshlearn.runlog import JsonlLog
from meshlearn.sgd import local_gradient, local_step
from meshlearn.tasks import task_of
from meshlearn.topology import Graph
from meshlearn.topology.sampling import dynamic_rounds
from meshlearn.transport import Endpoint

IterationHook = Callable[["Node", int, dict], None]


class Node:
    """One participant of a run: a model, a data shard, an optimizer, an algorithm, a transport.

    It owns one endpoint and knows nothing about processes, so a launcher may host one node
    per process or many per process. The constructor only builds; ``run()`` connects, trains
    and closes the transport on every exit path. With ``checkpoints`` it keeps its state when
    the configuration says (``checkpoint_due``); with ``resume`` too, it starts from its
    checkpoint of that iteration (its log cut back to it). ``joining``: it joins a group already
    training, at the iteration its algorithm finds (``Algorithm.joined_at``); ``members``: the ranks
    of a group that takes in nodes as it runs (its other members, for a joining node).
    """

    def __init__(
        self,
        rank: int,
        config: ExperimentConfig,
        graph: Graph,
        dataset: Dataset,
        indices,
        model: nn.Module,
        make_transport: Callable[[FlatState], Endpoint],
        log: JsonlLog | None = None,
        shard_sizes: Sequence[int] = (),
        checkpoints: RunCheckpoints | None = None,
        resume: int | None = None,
        joining: bool = False,
        members: Sequence[int] | None = None,
    ):
        self.rank = rank
        self.checkpoints, self.resume = checkpoints, resume
        self.config = config
        self.graph = graph
        self.dataset, self.validation = split_validation(dataset, config.validation, config.seed)
        self.task = task_of(self.dataset)  # what the model learns: its loss and metrics
        self._shard_set: Dataset | None = None  # its shard as a test set, built at its first use
        self.device = torch.device(config.device)
        self.model = model.to(self.device)
        self.flat = FlatState(self.model)
        self.parameters = list(self.model.parameters())  # views into self.flat.params, in its order
        self.optimizer = optimizer_of(config, self.flat.params.unsqueeze(0))
        self.loader = ShardLoader(dataset, indices, config.batch_size,  # DP-SGD: batches no one can draw again
                                  seed=secret_seed() if secret_batches(config) else loader_seed(config.seed, rank))
        self.steps = config.rounds * (self.loader.batches_per_epoch if config.full_epochs else 1)
        self.privacy = Privacy.of(config, PrivateNodes((rank,), (len(indices),), self.steps, str(self.device),
                                                       self.flat.params.numel()))
        self.per_example = None if self.privacy.clip_norm is None else PrivateGradients(  # DP-SGD's clipped sums
            self.model, self.privacy.clip_norm, self.task.loss)
        self.skips_idle = steps_rows_apart(config.optimizer)  # an iteration not asking for its steps is skipped
        self.transport = make_transport(self.flat)
        transport = self.transport
        attackers = config.attackers()
        self.behaviour = attackers.get(rank)  # this node's bad behaviour, if it is one
        self.attack = None if self.behaviour is None else make_attack(self.behaviour)
        self.algorithm: Algorithm = make_algorithm(config.algorithm, AlgorithmContext(
            rank, self.flat, transport, graph, settings=config.settings_of(config.algorithm), seed=config.seed,
            samples=len(self.loader.indices), shard_sizes=tuple(shard_sizes), iterations=config.iterations,
            steps=self.steps, rule=config.aggregation, sharing=config.sharing,
            sampler=dynamic_rounds(config.peer_sampling, config.topology, config.nodes, config.seed),
            attack=self.attack, initial=None if self.attack is None else self.flat.state.detach().clone(),
            colluders=frozenset(attackers) - {rank} if self.attack is not None else frozenset(), joining=joining,
            members=None if members is None else tuple(members), privacy=self.privacy, mixing=config.mixing,
            objective=config.objective))
        self.optimizer = self.algorithm.local_optimizer(self.optimizer)  # a stand-in where it steps itself
        self.log = log
        self.hooks: list[IterationHook] = []
        self.slowdown = config.slowdown_of(rank)

    def contacts(self, book: Mapping[int, str]) -> dict[int, str]:
        """The addresses, from everyone's ``book``, that this node talks to: its neighbours, every
        other node for an algorithm whose group is the whole run (leader aggregation), or the
        server (node 0, which talks to everyone) for FedAvg."""
        if self.algorithm.talks_to == "everyone" or (self.algorithm.talks_to == "server" and self.rank == 0):
            return {j: address for j, address in book.items() if j != self.rank}
        if self.algorithm.talks_to == "server":
            return {0: book[0]}
        return {j: book[j] for j in self.graph.neighbours(self.rank)}

    def train_step(self) -> float:
        """One mini-batch SGD step on the local shard; returns the loss."""
        started = time.perf_counter()
        try:
            return self._sgd_step()
        finally:
            factor, extra = self.slowdown
            if factor > 1 or extra > 0:  # emulated slowness (a straggler, or a device-bound step)
                time.sleep((factor - 1) * (time.perf_counter() - started) + extra)

    def peers_report(self) -> dict:
        """The peers whose models this node refused or found deviant, and those it suspects."""
        return self.algorithm.peers_report()

    def _sgd_step(self) -> float:
        x, y = self.loader.next_batch()
        if self.attack is not None and self.attack.flips_labels:
            y = LabelFlip.flip(y, self.dataset.num_classes)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.privacy.changes_steps:
            return self._private_step(x, y)
        return float(local_step(self.model, self.parameters, self.optimizer, x, y, self.task.loss).detach())

    def _private_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """A step the privacy mechanisms change: the batch's gradient (each example's clipped and
        summed, where one asks: DP-SGD), their ``local_step`` (DP-SGD's noise), the update; the loss."""
        grads, loss = (local_gradient(self.model, self.parameters, x, y, self.task.loss) if self.per_example is None
                       else clipped_gradient(self.model, self.per_example.names, self.per_example, x, y))
        self.privacy.local_step((0,), grads)
        self.optimizer.step(grads)
        return float(loss.detach())

    def evaluate(self, full: bool = False) -> Evaluation:
        """Loss and accuracy on the test set (limited by ``eval_samples``); all metrics if ``full``."""
        return evaluate_model(self.model, self.dataset, self.device, self.config.eval_samples, full)

    def evaluations(self) -> tuple[Evaluation | None, Evaluation | None]:
        """The evaluations an eval event holds beyond the test set's (``more_evaluations``): on the
        validation set, and over the node's whole training shard."""
        return more_evaluations(self.config, self.validation, self._validate, self._evaluate_shard)

    def _validate(self) -> Evaluation:
        return evaluate_model(self.model, self.validation, self.device, self.config.eval_samples)

    def _evaluate_shard(self) -> Evaluation:
        if self._shard_set is None:
            self._shard_set = shard_as_test_set(self.dataset, self.loader.indices)
        return evaluate_model(self.model, self._shard_set, self.device)

    def _parts(self, outer: dict | None, algorithm: bool = True) -> dict:
        """What a checkpoint keeps of this node (``algorithm``: its algorithm's state too)."""
        parts = {"model": self.model.state_dict(), "optimizer": self.optimizer, "loader": self.loader.batches,
                 "outer": outer, "torch_rng": torch.get_rng_state(), "stats": self.transport.stats.as_dict()}
        return {**parts, "algorithm": self.algorithm} if algorithm else parts

    def _restore(self, outer: dict | None) -> tuple[dict, dict]:
        """Load this node's checkpoint of ``resume`` into its model, optimizer, batch order, outer
        state, random generator and counters (``restore_run``; its algorithm's state:
        ``_say_started``, once it has started); cut its log back to it. Returns (meta, the
        checkpoint's tree)."""
        meta, tree, values = restore_run(self.checkpoints, self.resume, self._parts(outer, algorithm=False),
                                         self.device, self.privacy, None if self.log is None else self.log.path)
        counters = self.transport.stats.as_dict()  # what this transport counts
        self.transport.stats.add(**{name: int(count) for name, count in values["stats"].items() if name in counters})
        return meta, tree

    def _say_started(self, tree: dict) -> None:
        """The log's first event of this run: resumed from a checkpoint (its algorithm's state
        restored from ``tree``), or started."""
        if self.resume is not None:
            self.checkpoints.restore({"algorithm": tree["algorithm"]}, {"algorithm": self.algorithm}, self.device)
            self.write({"event": "resumed", "rank": self.rank, "iteration": self.resume, "time": time.time()})
            return
        self.write({
            "event": "start", "rank": self.rank, "neighbours": self.graph.neighbours(self.rank),
            "samples": len(self.loader.indices), "parameters": self.flat.params.numel(),
            "state_bytes": self.flat.nbytes, "threads": torch.get_num_threads(), "time": time.time(),
            "byzantine": None if self.behaviour is None else str(self.behaviour),
        })

    def save(self, done: int, outer: dict | None, elapsed: float) -> None:
        """Keep this node's checkpoint after ``done`` iterations (``outer``: its outer optimizer's state)."""
        self.checkpoints.save(done, self._parts(outer), elapsed=elapsed, rank=self.rank)

    def write(self, event: dict) -> None:
        """Add ``event`` to the node's log (none without one)."""
        if self.log is not None:
            self.log.write(event)

    def run(self, peers: Mapping[int, str]) -> dict:
        """Connect to the neighbours (id -> address), run every iteration, and return a summary."""
        config = self.config
        try:
            outer = config.outer.begin(self.flat.params.detach().unsqueeze(0)) if config.outer.active else None
            meta, tree = self._restore(outer) if self.resume is not None else ({}, {})
            self.transport.connect(peers)
            self.algorithm.start()
            if self.algorithm.joined_at is not None and outer is not None:  # a newcomer: the outer optimizer
                outer = config.outer.begin(self.flat.params.detach().unsqueeze(0))  # from the group's model
            self._say_started(tree)
            iterations = NodeIterations(self, outer, time.perf_counter() - float(meta.get("elapsed", 0.0)))
            first = self.resume if self.resume is not None else (self.algorithm.joined_at or 0)  # a newcomer's
            drive(iterations, config, first)
            last = iterations.last
            final = (last if last is not None and config.iterations > 0 else self.evaluate(full=True)) \
                if iterations.evaluates else None
            self.algorithm.stop()
            summary = {
                "event": "final", "rank": self.rank, "elapsed": time.perf_counter() - iterations.start,
                "stats": self.transport.stats.as_dict() | self.transport.extra_stats(),
                "metrics": None if final is None else final.as_dict(),
                "peers": self.peers_report(),
                **self.privacy.report(0),  # DP-SGD's epsilon, central DP's
            }
            self.write(summary)
            return summary
        finally:
            self.transport.close()
            if self.log is not None:
                self.log.close()
