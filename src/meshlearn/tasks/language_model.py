"""Language modelling: the next token at every position of a window of text; loss per token,
perplexity and bits per token (per byte with byte tokens); next-token accuracy."""

from __future__ import annotations

import math

import torch

from meshlearn.tasks.base import Task, register_task


@register_task
class LanguageModel(Task):
    """Next-token cross-entropy, averaged over every position of every window."""

    name = "language-model"

    def evaluation(self, total_loss: float, targets: torch.Tensor, preds: torch.Tensor, num_classes: int,
                   full: bool = False):
        evaluation = super().evaluation(total_loss, targets, preds, num_classes, False)  # no confusion matrix
        evaluation.perplexity = perplexity(evaluation.loss)
        evaluation.bits_per_token = evaluation.loss / math.log(2)
        return evaluation


def perplexity(loss: float) -> float:
    """``exp(loss)``, infinite past float's range (a diverged model)."""
    return math.exp(loss) if loss < 700 else float("inf")
