"""Test-set metrics of many nodes' models at once."""

from __future__ import annotations

import torch

from meshlearn.batched.models import NodeModels
from meshlearn.data import Dataset, test_samples
from meshlearn.evaluation import EVAL_BATCH
from meshlearn.metrics import Evaluation
from meshlearn.tasks import task_of

FINGERPRINT = 64  # values of a row whose bytes key it, before torch.equal compares whole rows


@torch.no_grad()
def evaluate_nodes(models: NodeModels, ranks: list[int], dataset: Dataset, limit: int = 0,
                   full: bool = False, rows: torch.Tensor | None = None) -> dict[int, Evaluation]:
    """Each of ``ranks``' models on the test set (``limit`` samples of it, ``test_samples``; 0 = all), as
    ``evaluate_model`` measures one model; all metrics if ``full``. ``rows``: the states to
    evaluate (one per rank: a snapshot) instead of the nodes' current ones. Nodes holding the same
    model (bitwise: FedAvg's after the server's answer) are evaluated once."""
    if not ranks:
        return {}
    states = models.stacked.state if rows is None else rows
    positions = ranks if rows is None else list(range(len(ranks)))
    distinct, twin = distinct_rows(states, positions)
    chosen = [ranks[k] for k in distinct]
    task = task_of(dataset)
    xs, ys = test_samples(dataset, limit)
    device = models.stacked.state.device
    losses = torch.zeros(len(chosen), dtype=torch.float64)
    preds = []
    for start in range(0, len(ys), EVAL_BATCH):
        x = dataset.normalize(xs[start:start + EVAL_BATCH]).to(device)
        y = ys[start:start + EVAL_BATCH].to(device)
        outputs = models.logits(chosen, x, None if rows is None else rows[distinct])  # [nodes, b, ..., classes]
        losses += task.loss_sums(outputs, y).double().cpu()
        preds.append(task.predictions(outputs).flatten(1).cpu())
    preds = torch.cat(preds, 1)
    results = [task.evaluation(float(losses[k]), ys, preds[k], dataset.num_classes, full) for k in range(len(chosen))]
    return {rank: results[twin[k]] for k, rank in enumerate(ranks)}


def distinct_rows(states: torch.Tensor, positions: list[int]) -> tuple[list[int], list[int]]:
    """Of the rows ``positions`` of ``states``: which of them (indices into ``positions``) hold
    distinct models, and for each one the index, among those, of the row holding its model
    (bitwise equal rows are one model: the bytes of a few of their values find candidates,
    ``torch.equal`` decides)."""
    index = torch.tensor(positions, device=states.device)
    columns = torch.linspace(0, states.shape[1] - 1, min(FINGERPRINT, states.shape[1])).long().to(states.device)
    sample = states[index[:, None], columns[None, :]].cpu().numpy()
    keys = [row.tobytes() for row in sample]
    distinct: list[int] = []
    twin: list[int] = []
    by_key: dict[bytes, list[int]] = {}
    for k, (position, key) in enumerate(zip(positions, keys)):
        same = next((d for d in by_key.get(key, []) if torch.equal(states[position], states[positions[distinct[d]]])),
                    None)
        if same is None:
            same = len(distinct)
            by_key.setdefault(key, []).append(same)
            distinct.append(k)
        twin.append(same)
    return distinct, twin
