"""The coordinate-wise median (Yin et al. 2018)."""

from __future__ import annotations

import torch

from meshlearn.aggregation.base import AggregationRule, register_rule


@register_rule("median")
class Median(AggregationRule):
    """Per coordinate, the median of the K values (the mean of the two middle ones for even K);
    weights are not used. Stops fewer than half the models being bad, per coordinate."""

    def aggregate(self, models: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = models.shape[-2]
        ordered = models.sort(dim=-2).values
        if k % 2:
            return ordered[..., k // 2, :].clone()
        return ordered[..., k // 2 - 1: k // 2 + 1, :].mean(-2)
