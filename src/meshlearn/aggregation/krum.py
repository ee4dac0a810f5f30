"""Krum and Multi-Krum (Blanchard et al. 2017)."""

from __future__ import annotations

import torch

from meshlearn.aggregation.base import AggregationRule, pairwise_sq_distances, register_rule


def krum_scores(models: torch.Tensor, f: int) -> torch.Tensor:
    """``[..., K]``: each model's sum of squared distances to its ``K - f - 2`` nearest others
    (at least 1, at most ``K - 1``)."""
    k = models.shape[-2]
    if k == 1:
        return models.new_zeros(models.shape[:-1], dtype=torch.float64)
    nearest = min(k - 1, max(1, k - f - 2))
    distances = pairwise_sq_distances(models)
    distances.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    return distances.topk(nearest, dim=-1, largest=False).values.sum(-1)


@register_rule("multi-krum")
class MultiKrum(AggregationRule):
    """The mean of the ``m`` models with the lowest Krum scores (``f``: how many may be bad);
    weights are not used. Stops up to ``f`` bad models where ``K > 2f + 2``."""

    def __init__(self, f: int = 1, m: int = 1):
        if f < 0 or m < 1:
            raise ValueError("F must be at least 0 and M at least 1")
        self.f, self.m = int(f), int(m)

    def aggregate(self, models: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        scores = krum_scores(models, self.f)
        m = min(self.m, models.shape[-2])
        # ties go to the lower index (the node's own model first): stable, so results repeat
        chosen = scores.argsort(dim=-1, stable=True)[..., :m]
        picked = models.gather(-2, chosen.unsqueeze(-1).expand(*chosen.shape, models.shape[-1]))
        return picked.mean(-2)

    def __str__(self) -> str:
        return f"multi-krum:{self.f}:{self.m}"


@register_rule("krum")
class Krum(MultiKrum):
    """The one model with the lowest Krum score (``f``: how many may be bad)."""

    def __init__(self, f: int = 1):
        super().__init__(f, 1)

    def __str__(self) -> str:
        return f"krum:{self.f}"
