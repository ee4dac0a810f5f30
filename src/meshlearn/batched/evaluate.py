"""Test-set metrics of many nodes' models at once."""

from __future__ import annotations

import torch
from torch import nn

from meshlearn.batched.models import NodeModels
from meshlearn.data import Dataset, test_samples
from meshlearn.evaluation import EVAL_BATCH, Evaluation, evaluation_of


@torch.no_grad()
def evaluate_nodes(models: NodeModels, ranks: list[int], dataset: Dataset, limit: int = 0,
                   full: bool = False, rows: torch.Tensor | None = None) -> dict[int, Evaluation]:
    """Each of ``ranks``' models on the test set (``limit`` samples of it, ``test_samples``; 0 = all), as
    ``evaluate_model`` measures one model; all metrics if ``full``. ``rows``: the states to
    evaluate (one per rank: a snapshot) instead of the nodes' current ones."""
    if not ranks:
        return {}
    xs, ys = test_samples(dataset, limit)
    device = models.stacked.state.device
    losses = torch.zeros(len(ranks), dtype=torch.float64)
    preds = []
    for start in range(0, len(ys), EVAL_BATCH):
        x = dataset.normalize(xs[start:start + EVAL_BATCH]).to(device)
        y = ys[start:start + EVAL_BATCH].to(device)
        logits = models.logits(ranks, x, rows)  # [nodes, b, classes]
        per_sample = nn.functional.cross_entropy(logits.flatten(0, 1), y.repeat(len(ranks)), reduction="none")
        losses += per_sample.view(len(ranks), -1).sum(1).double().cpu()
        preds.append(logits.argmax(2).cpu())
    preds = torch.cat(preds, 1)
    return {rank: evaluation_of(float(losses[k]), ys, preds[k], dataset.num_classes, full)
            for k, rank in enumerate(ranks)}
