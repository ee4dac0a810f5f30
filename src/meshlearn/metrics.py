"""Classification metrics from predictions: accuracy, macro precision/recall/F1, confusion matrix."""

from __future__ import annotations

import torch


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
