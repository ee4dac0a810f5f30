"""The weighted arithmetic mean: FedAvg's rule, and what plain averaging does."""

from __future__ import annotations

from typing import Sequence

import torch

from meshlearn.aggregation.base import check_inputs, register_rule


@register_rule("mean")
def mean(models: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum(w_i * m_i) / sum(w_i)``, accumulated in the models' order (so results repeat bit for bit)."""
    check_inputs(models, weights)
    total = float(sum(weights))
    result = torch.zeros_like(models[0])
    with torch.no_grad():
        for model, weight in zip(models, weights):
            if weight:
                result.add_(model.to(result.device), alpha=weight / total)
    return result
