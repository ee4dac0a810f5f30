"""The interface every aggregation rule implements, and the registry that names them."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from meshlearn.errors import ConfigError


class AggregationRule(Protocol):
    """``rule(models, weights)``: one model from equally shaped models and their non-negative
    weights (at least one positive). Must not modify its inputs."""

    def __call__(self, models: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor: ...


RULES: dict[str, AggregationRule] = {}


def register_rule(name: str) -> Callable[[AggregationRule], AggregationRule]:
    """Decorator adding a rule to the registry under ``name``."""

    def decorate(rule: AggregationRule) -> AggregationRule:
        RULES[name] = rule
        return rule

    return decorate


def get_rule(name: str) -> AggregationRule:
    """The rule registered under ``name``; ConfigError lists the known ones otherwise."""
    rule = RULES.get(name)
    if rule is None:
        raise ConfigError(f"unknown aggregation rule {name!r}: choose one of {', '.join(sorted(RULES))}")
    return rule


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
