"""The weighted arithmetic mean: FedAvg's rule, and what plain averaging (D-PSGD, gossip) does."""

from __future__ import annotations

import torch

from meshlearn.aggregation.base import AggregationRule, normalised, register_rule


@register_rule("mean")
class Mean(AggregationRule):
    """``sum(w_i * m_i) / sum(w_i)``. No defence: one bad model moves the result without bound."""

    robust = False

    def aggregate(self, models: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...k,...kp->...p", normalised(weights, models.dtype), models)


mean = Mean()
