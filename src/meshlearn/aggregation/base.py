"""The interface every aggregation rule implements, and the registry that names them."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from meshlearn.plugins import Registry


class AggregationRule(Protocol):
    """``rule(models, weights)``: one model from equally shaped models and their non-negative
    weights (at least one positive). Must not modify its inputs."""

    def __call__(self, models: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor: ...


RULES: Registry[AggregationRule] = Registry("aggregation rule")
register_rule = RULES.register  # decorator: @register_rule("name")
get_rule = RULES.get  # the rule registered under a name; ConfigError lists the known ones otherwise


def check_inputs(models: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
    """Raise ValueError unless the models and weights fit the rule interface."""
    if not models or len(models) != len(weights):
        raise ValueError(f"{len(models)} model(s) and {len(weights)} weight(s): give one weight per model, "
                         "and at least one model")
    if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError("weights must be non-negative, and at least one positive")
    shape = models[0].shape
    if any(m.shape != shape for m in models):
        raise ValueError("models of different shapes cannot be aggregated")
