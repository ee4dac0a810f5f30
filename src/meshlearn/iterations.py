"""The iteration loop both engines run, written once.

An iteration is, in this order: the learning rate of the schedule, the algorithm's hook before the
local steps, the local steps, the exchange, the outer optimizer's step on the exchange's aggregate,
the iteration's record (with the test evaluation when one is due), and a checkpoint when one is
due. Each engine says what each of those is for its nodes (``IterationSteps``: the process
engine's one node, the batched engine's every node at once); ``drive`` calls them in that order,
so the order is one rule, not two loops kept alike by hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from meshlearn.config import ExperimentConfig


class IterationSteps(Protocol):
    """An engine's part of each iteration (see the module); ``drive`` calls them in order."""

    def set_lr(self, lr: float) -> None:
        """Train the coming steps at ``lr`` (only called for a schedule that is not constant)."""

    def begin(self, iteration: int) -> None:
        """Before the local steps of ``iteration`` (the algorithm's hook)."""

    def train(self, iteration: int) -> Any:
        """The local steps of ``iteration``; returns what ``exchange`` needs of them."""

    def exchange(self, iteration: int, trained: Any) -> Any:
        """The algorithm's exchange after the local steps; returns the iteration's record so far."""

    def outer_step(self, iteration: int) -> None:
        """The outer optimizer's step on the exchange's aggregate (only with an outer optimizer)."""

    def finish(self, iteration: int, record: Any, evaluate: bool) -> None:
        """The iteration's record written (its test evaluation first where ``evaluate``)."""

    def save(self, done: int) -> None:
        """Keep a checkpoint of the run after ``done`` iterations."""


def evaluation_due(done: int, config: "ExperimentConfig") -> bool:
    """Whether the nodes are tested once ``done`` iterations are done: every ``test_after``, and at the end."""
    return done % config.test_after == 0 or done == config.iterations


def drive(steps: IterationSteps, config: "ExperimentConfig", first: int = 0) -> None:
    """Run iterations ``first`` .. ``config.iterations - 1`` through ``steps``, in the module's order."""
    schedule = config.lr_schedule
    for iteration in range(first, config.iterations):
        if not schedule.constant:  # every node at this iteration's rate, on either engine
            steps.set_lr(config.lr * schedule.factor(iteration, config.iterations))
        steps.begin(iteration)
        record = steps.exchange(iteration, steps.train(iteration))
        if config.outer.active:
            steps.outer_step(iteration)
        done = iteration + 1
        steps.finish(iteration, record, evaluate=evaluation_due(done, config))
        if config.checkpoint_due(done):
            steps.save(done)
