"""Self-centred distance filtering: drop the models far beyond the nearest one."""

from __future__ import annotations

import torch

from meshlearn.aggregation.base import AggregationRule, distances_to_own, normalised, register_rule


@register_rule("filter")
class NearestFilter(AggregationRule):
    """``x_0 + sum_j w_j keep_j (x_j - x_0)``: a neighbour's model counts only if its distance to the
    node's own (row 0) is at most ``c`` times the nearest neighbour's; the weight of one left out
    stays with the node's own model. Unlike clipping, a far model pulls by nothing at all, so a bad
    majority sending far-away models (sign flips, noise, a stale model) cannot drag the node off
    however many rounds it keeps trying, as long as one neighbour is honest and nearest. What it
    cannot stop: a bad model closer than every honest one (it then sets the scale and may leave
    the honest ones out: the node trains alone beside it). The distance-based selection stage of
    UBAR/MOZI (Guo et al. 2020, 2021), with an adaptive radius instead of a fixed share."""

    def __init__(self, c: float = 3.0):
        if not c >= 1:
            raise ValueError("C must be at least 1 (the nearest neighbour always counts)")
        self.c = float(c)

    def aggregate(self, models: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        own = models[..., 0, :]
        if models.shape[-2] == 1:
            return own.clone()
        distances = distances_to_own(models)
        if not bool(torch.isfinite(distances).all()):  # an infinite model is left out, and 0 * inf is NaN
            models = torch.nan_to_num(models, nan=0.0, posinf=0.0, neginf=0.0)
            distances = torch.nan_to_num(distances, nan=torch.inf)
        keep = distances <= self.c * distances.min(dim=-1, keepdim=True).values
        c = normalised(weights, torch.float64)[..., 1:] * keep
        coefficients = torch.cat([1.0 - c.sum(-1, keepdim=True), c], dim=-1)
        return torch.einsum("...k,...kp->...p", coefficients.to(models.dtype), models)

    def __str__(self) -> str:
        return f"filter:{self.c:g}"
