"""The process engine's part of each iteration (``iterations.IterationSteps``) for its one node:
its local steps, its algorithm's exchange, its outer step, its log record and evaluation, its
checkpoints. ``iterations.drive`` calls them in the order both engines share."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from meshlearn.iterations import IterationSteps, evaluation_fields
from meshlearn.metrics import Evaluation

if TYPE_CHECKING:
    from meshlearn.node.node import Node


class NodeIterations(IterationSteps):
    """One node's iterations: ``outer`` is its outer optimizer's state (None without one), ``start``
    the ``perf_counter`` its elapsed time counts from; ``last`` holds its latest test evaluation."""

    def __init__(self, node: "Node", outer: dict | None, start: float):
        self.node, self.outer, self.start = node, outer, start
        self.evaluates = node.config.node_evaluates(node.rank)
        self.last: Evaluation | None = None

    def set_lr(self, lr: float) -> None:
        self.node.optimizer.set_lr(lr)

    def begin(self, iteration: int) -> None:
        self.node.algorithm.before_local_steps(iteration)

    def train(self, iteration: int) -> tuple[float | None, float]:
        """(the mean loss of the local steps, or None where none ran; their seconds)."""
        node = self.node
        losses, train_time = [], 0.0
        for _ in range(0 if self._idle(iteration) else node.steps):
            node.algorithm.before_step()
            t0 = time.perf_counter()
            losses.append(node.train_step())
            train_time += time.perf_counter() - t0
            node.algorithm.after_step(losses[-1])
        return (sum(losses) / len(losses) if losses else None), train_time

    def _idle(self, iteration: int) -> bool:
        """Whether the node skips ``iteration``'s steps: not asked for them, where its optimizer allows."""
        return self.node.skips_idle and not self.node.algorithm.trains(iteration)

    def exchange(self, iteration: int, trained: tuple[float | None, float]) -> dict:
        train_loss, train_time = trained
        record = self.node.algorithm.after_local_steps(iteration, train_loss)
        record.update(train=train_time, train_loss=train_loss)
        return record

    def outer_step(self, iteration: int) -> None:
        node = self.node
        with torch.no_grad():  # the exchange's result is an aggregate: the outer optimizer's step
            node.config.outer.step(node.flat.params.detach().unsqueeze(0), self.outer,
                                   node.algorithm.aggregated(iteration))

    def finish(self, iteration: int, record: dict, evaluate: bool, full: bool = False) -> None:
        node = self.node
        node.algorithm.check()
        record.update(event="iteration", iteration=iteration, bytes_sent=node.transport.stats.bytes_sent)
        if evaluate and self.evaluates:
            t2 = time.perf_counter()
            self.last = node.evaluate(full=full)  # the last one is also the final one
            record["eval"] = time.perf_counter() - t2
            node.write(self._evaluation_event(iteration + 1))
            record.update(test_acc=self.last.accuracy, test_loss=self.last.loss)  # for the iteration hooks
        record["t"] = time.perf_counter() - self.start
        node.write(record)
        for hook in node.hooks:
            hook(node, iteration, record)

    def _evaluation_event(self, done: int) -> dict:
        """The log's eval event after ``done`` iterations (the test evaluation ``last``)."""
        node = self.node
        return {
            "event": "eval", "iteration": done, "t": time.perf_counter() - self.start,
            **evaluation_fields(self.last, *node.evaluations()),
            **node.privacy.progress(0, done),  # DP-SGD: the epsilon spent so far
            "bytes_sent": node.transport.stats.bytes_sent,  # accuracy against bytes
        }

    def save(self, done: int) -> None:
        if self.node.checkpoints is not None:
            self.node.save(done, self.outer, time.perf_counter() - self.start)
