"""The task interface: how a model's outputs and a batch's targets become a loss, predictions and
an evaluation's metrics. Both engines, the network's providers and the dpwa adapter call it."""

from __future__ import annotations

from abc import ABC
from typing import TYPE_CHECKING, ClassVar

import torch
from torch.nn import functional as F

from meshlearn.metrics import Evaluation, evaluation_of
from meshlearn.tasks.spec import TASKS

if TYPE_CHECKING:
    from meshlearn.data import Dataset


class Task(ABC):
    """What a model learns. Outputs are scores over ``num_classes`` in the last dimension
    (classification: [B, C]; a language model: [B, T, V]) and targets their classes ([B], [B, T]);
    by default the loss is the cross-entropy averaged over every target, as both built-in tasks
    train."""

    name: ClassVar[str]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch (what training minimizes). Targets may be stored narrow (a text
        corpus's byte tokens): they are read as class indices."""
        return F.cross_entropy(outputs.flatten(0, -2), targets.flatten().long())

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss of one model's batch (evaluation adds batches up, and divides by the targets)."""
        return F.cross_entropy(outputs.flatten(0, -2), targets.flatten().long(), reduction="sum")

    def loss_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss of a batch for each of M models: ``outputs`` [M, *one model's outputs],
        ``targets`` one batch's; [M] (evaluation adds batches up, and divides by the targets)."""
        many = targets.unsqueeze(0).expand(outputs.shape[0], *targets.shape)
        per_target = F.cross_entropy(outputs.flatten(0, -2), many.flatten().long(), reduction="none")
        return per_target.view(outputs.shape[0], -1).sum(1)

    def predictions(self, outputs: torch.Tensor) -> torch.Tensor:
        """The predicted class of every target (outputs' shape without its last dimension)."""
        return outputs.argmax(-1)

    def evaluation(self, total_loss: float, targets: torch.Tensor, preds: torch.Tensor, num_classes: int,
                   full: bool = False) -> Evaluation:
        """The Evaluation of ``preds`` of ``targets`` (both flat) whose losses sum to ``total_loss``."""
        return evaluation_of(total_loss, targets.flatten(), preds, num_classes, full)


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator adding a task to the registry under ``cls.name``."""
    return TASKS.add(cls.name, cls)


def task_of(dataset: Dataset) -> Task:
    """The task a dataset is trained for (its ``task``)."""
    return TASKS.get(dataset.task)()
