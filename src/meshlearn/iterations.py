"""The iteration loop both engines run, written once.

An iteration is, in this order: the learning rate of the schedule, the algorithm's hook before the
local steps, the local steps, the exchange, the outer optimizer's step on the exchange's aggregate,
the iteration's record (with the test evaluation when one is due), and a checkpoint when one is
due. Each engine says what each of those is for its nodes (``IterationSteps``: the process
engine's one node, the batched engine's every node at once); ``drive`` calls them in that order,
so the order is one rule, not two loops kept alike by hand. What both engines' records and
resumes share is here too: which evaluations an eval event holds (``more_evaluations``) and a
node's fields of it (``evaluation_fields``), and the restore of a run from its checkpoint
(``restore_run``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from meshlearn.checkpoint import RunCheckpoints
    from meshlearn.config import ExperimentConfig
    from meshlearn.metrics import Evaluation
    from meshlearn.privacy.mechanism import Privacy

T = TypeVar("T")


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

    def finish(self, iteration: int, record: Any, evaluate: bool, full: bool = False) -> None:
        """The iteration's record written (its test evaluation first where ``evaluate``: of every
        metric where ``full``, the run's last)."""

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
        steps.finish(iteration, record, evaluate=evaluation_due(done, config), full=done == config.iterations)
        if config.checkpoint_due(done):
            steps.save(done)


def more_evaluations(config: ExperimentConfig, validation: Any, on_validation: Callable[[], T],
                     on_shards: Callable[[], T]) -> tuple[T | None, T | None]:
    """What an eval event holds beyond the test set's evaluation, in either engine: the evaluation
    on the ``validation`` set where the run holds one out (``on_validation()``), and on the nodes'
    own training shards where the run asks for it (``train_evaluate``: ``on_shards()``)."""
    return on_validation() if validation is not None else None, on_shards() if config.train_evaluate else None


def evaluation_fields(test: Evaluation, validation: Evaluation | None = None,
                      shard: Evaluation | None = None) -> dict[str, float]:
    """A node's fields of an eval event, in either engine's log: its ``test`` loss and accuracy (a
    language model's perplexity too), and where evaluated, on the ``validation`` set and on its
    own training ``shard``."""
    fields = {"test_loss": test.loss, "test_acc": test.accuracy}
    if test.perplexity is not None:
        fields["test_perplexity"] = test.perplexity
    if validation is not None:
        fields.update(val_loss=validation.loss, val_acc=validation.accuracy)
    if shard is not None:
        fields.update(shard_loss=shard.loss, shard_acc=shard.accuracy)
    return fields


def restore_run(checkpoints: RunCheckpoints, resume: int, parts: dict[str, Any], device: torch.device | str,
                privacy: Privacy, log: str | Path | None) -> tuple[dict, dict, dict]:
    """Continue a run from its checkpoint of ``resume`` iterations, in either engine: its ``parts``
    (what ``checkpoints.save`` was given; a part the checkpoint holds more of is the caller's to
    restore), the random generators as they were (torch's, and CUDA's where kept), the privacy
    mechanisms' count of steps, and the ``log`` cut back to it (only once the checkpoint has
    loaded: a bad one leaves the folder as it was). Returns (meta, the checkpoint's tree, the values
    restored)."""
    import torch

    from meshlearn.runlog import truncate_log

    meta, tree = checkpoints.load(resume)
    values = checkpoints.restore(tree, parts, device)
    torch.set_rng_state(values["torch_rng"])
    if "cuda_rng" in values:
        torch.cuda.set_rng_state(values["cuda_rng"].cpu(), device)
    privacy.resumed(resume)  # DP-SGD: the epsilon counts the steps before the checkpoint too
    if log is not None:
        truncate_log(log, resume)
    return meta, tree, values
