"""A model's test-set metrics: loss, accuracy, macro precision / recall / F1, confusion matrix."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from meshlearn.data import Dataset, test_samples
from meshlearn.metrics import classification_report, confusion_matrix

EVAL_BATCH = 128  # test samples per forward pass: bounds a node's activations (LeNet: 17 MB a layer)


@dataclass
class Evaluation:
    """Test-set loss, accuracy and (for final reports) the full classification metrics."""

    loss: float
    accuracy: float
    precision: float
    recall: float
    f1: float
    confusion: list[list[int]] = field(default_factory=list)


@torch.no_grad()
def evaluate_model(model: nn.Module, dataset: Dataset, device: torch.device | str = "cpu",
                   limit: int = 0, full: bool = False) -> Evaluation:
    """A model's loss and accuracy on the test set (``limit`` samples of it, ``test_samples``; 0 =
    all); all metrics if ``full``."""
    xs, ys = test_samples(dataset, limit)
    model.eval()
    total_loss = 0.0
    preds = []
    for start in range(0, len(ys), EVAL_BATCH):
        x = dataset.normalize(xs[start:start + EVAL_BATCH]).to(device)
        y = ys[start:start + EVAL_BATCH].to(device)
        logits = model(x)
        total_loss += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        preds.append(logits.argmax(1).cpu())
    return evaluation_of(total_loss, ys, torch.cat(preds), dataset.num_classes, full)


def evaluation_of(total_loss: float, targets: torch.Tensor, preds: torch.Tensor, num_classes: int,
                  full: bool = False) -> Evaluation:
    """The Evaluation of predictions ``preds`` of ``targets`` whose cross-entropy losses sum to ``total_loss``."""
    confusion = confusion_matrix(targets, preds, num_classes)
    report = classification_report(confusion)
    return Evaluation(
        loss=total_loss / max(1, len(targets)),
        accuracy=report["accuracy"],
        precision=report["precision"],
        recall=report["recall"],
        f1=report["f1"],
        confusion=confusion.tolist() if full else [],
    )
