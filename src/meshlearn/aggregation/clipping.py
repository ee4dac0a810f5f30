"""Self-centred clipping: ClippedGossip (He, Karimireddy and Jaggi 2022)."""

from __future__ import annotations

import torch

from meshlearn.aggregation.base import AggregationRule, distances_to_own, normalised, register_rule
from meshlearn.aggregation.spec import NEAREST


@register_rule("clip")
class SelfCentredClipping(AggregationRule):
    """``x_0 + sum_j w_j clip(x_j - x_0, tau)``: each other model's difference to the node's own
    (row 0) is shortened to at most ``tau``, then averaged with the weights. A bad neighbour moves
    the node by at most ``w_j * tau``. Without ``tau`` the radius adapts: the median of the
    neighbours' distances, so a minority of far-away models is clipped to the honest ones' scale.
    With ``tau="nearest"`` the radius is the distance to the nearest neighbour: a bad majority
    cannot widen it (only shrink it, which slows mixing), at some cost in accuracy without an
    attack. With a large ``tau`` it is the weighted mean."""

    def __init__(self, tau: float | str | None = None):
        if tau != NEAREST and tau is not None and (isinstance(tau, str) or tau <= 0):
            raise ValueError(f"TAU must be a positive number or {NEAREST!r}")
        self.tau = tau

    def radius(self, distances: torch.Tensor) -> torch.Tensor:
        """``[..., 1]``: the clipping radius for the neighbours' ``distances`` ``[..., K - 1]``."""
        if self.tau == NEAREST:
            return distances.min(dim=-1, keepdim=True).values
        if self.tau is not None:
            return torch.full_like(distances[..., :1], self.tau)
        k = distances.shape[-1]
        ordered = distances.sort(dim=-1).values
        return ordered[..., (k - 1) // 2: k // 2 + 1].mean(-1, keepdim=True)

    def aggregate(self, models: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        own = models[..., 0, :]
        if models.shape[-2] == 1:
            return own.clone()
        distances = distances_to_own(models)
        if not bool(torch.isfinite(distances).all()):  # an infinite model gets weight 0, and 0 * inf is NaN
            models = torch.nan_to_num(models, nan=0.0, posinf=0.0, neginf=0.0)
        scale = (self.radius(distances) / distances.clamp_min(1e-30)).clamp(max=1.0)
        # x_0 + sum_j c_j (x_j - x_0) = (1 - sum_j c_j) x_0 + sum_j c_j x_j: no differences stored
        c = normalised(weights, torch.float64)[..., 1:] * scale
        coefficients = torch.cat([1.0 - c.sum(-1, keepdim=True), c], dim=-1)
        return torch.einsum("...k,...kp->...p", coefficients.to(models.dtype), models)

    def __str__(self) -> str:
        if self.tau is None or self.tau == NEAREST:
            return ":".join(["clip", *([self.tau] if self.tau else [])])
        return f"clip:{self.tau:g}"
