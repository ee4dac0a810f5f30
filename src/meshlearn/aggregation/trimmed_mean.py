"""The coordinate-wise trimmed mean (Yin et al. 2018)."""

from __future__ import annotations

import torch

from meshlearn.aggregation.base import AggregationRule, register_rule


@register_rule("trimmed-mean")
class TrimmedMean(AggregationRule):
    """Per coordinate, drop the ``b`` largest and ``b`` smallest of the K values and average the
    rest (unweighted). Stops up to ``b`` bad models. Where fewer than ``2b + 1`` models are at hand
    (a small neighbourhood, or chunks lost), it trims ``(K - 1) // 2`` from each side."""

    def __init__(self, b: int = 1):
        if b < 0:
            raise ValueError("B must be at least 0")
        self.b = int(b)

    def aggregate(self, models: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = models.shape[-2]
        b = min(self.b, (k - 1) // 2)
        if b == 0:
            return models.mean(-2)
        return models.sort(dim=-2).values[..., b:k - b, :].mean(-2)

    def __str__(self) -> str:
        return f"trimmed-mean:{self.b}"

