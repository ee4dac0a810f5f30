"""Classification metrics from predictions: accuracy, macro precision/recall/F1, confusion matrix,
and ``Evaluation``, the record of them a task's evaluation returns (``meshlearn.tasks``; running a
model over the test set is ``meshlearn.evaluation``'s)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SHOWN_ROWS, SHOWN_COLUMNS = 4, 6  # the grid of test predictions a final report keeps (predictions.png)


@dataclass
class Evaluation:
    """Test-set loss (per target: per sample, or per token), accuracy (of the predicted class, or
    next token), macro precision / recall / F1 and, for final reports of classification, the
    confusion matrix. A language model's adds its perplexity and bits per token."""

    loss: float
    accuracy: float
    precision: float
    recall: float
    f1: float
    confusion: list[list[int]] = field(default_factory=list)
    shown: list[int] = field(default_factory=list)  # final reports: the predictions predictions.png shows
    perplexity: float | None = None
    bits_per_token: float | None = None

    def as_dict(self) -> dict:
        """The metrics as plain values, for logs and summaries (a task's metrics it lacks left out)."""
        return {name: value for name, value in self.__dict__.items() if value is not None}


def confusion_matrix(targets: torch.Tensor, preds: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Counts[i, j] of samples with true class i predicted as j."""
    flat = targets.to(torch.int64) * num_classes + preds.to(torch.int64)
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def classification_report(confusion: torch.Tensor) -> dict[str, float]:
    """Accuracy and macro-averaged precision, recall and F1 from a confusion matrix.

    Classes absent from both targets and predictions are left out of the macro averages.
    """
    confusion = confusion.to(torch.float64)
    tp = confusion.diag()
    predicted = confusion.sum(0)
    actual = confusion.sum(1)
    present = (predicted + actual) > 0
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(actual > 0, tp / actual.clamp(min=1), torch.zeros_like(tp))
    denom = precision + recall
    f1 = torch.where(denom > 0, 2 * precision * recall / denom.clamp(min=1e-12), torch.zeros_like(tp))
    total = confusion.sum()
    return {
        "accuracy": float(tp.sum() / total) if total > 0 else 0.0,
        "precision": float(precision[present].mean()) if present.any() else 0.0,
        "recall": float(recall[present].mean()) if present.any() else 0.0,
        "f1": float(f1[present].mean()) if present.any() else 0.0,
    }


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
        shown=preds[shown_positions(len(preds))].tolist() if full else [],
    )


def shown_positions(count: int) -> torch.Tensor:
    """The positions, among ``count`` evaluated test samples, of the ones predictions.png shows:
    SHOWN_ROWS x SHOWN_COLUMNS evenly spaced over them (all of them if fewer), the same on every
    node, engine and provider."""
    shown = min(count, SHOWN_ROWS * SHOWN_COLUMNS)
    return torch.arange(shown, dtype=torch.int64) * count // max(1, shown)
