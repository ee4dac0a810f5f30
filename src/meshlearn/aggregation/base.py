"""The interface every aggregation rule implements, and how a rule is built from its name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Sequence

import torch

from meshlearn.aggregation.spec import RULES, parse_rule
from meshlearn.errors import ConfigError


class AggregationRule(ABC):
    """One model from a node's own model and those it received, for a batch of nodes at once.

    ``models``: ``[..., K, P]``, row 0 the aggregating node's own model (the reference of
    self-centred rules), rows 1.. the others in any order; ``weights``: ``[..., K]``,
    non-negative, not all zero (Metropolis-Hastings weights, or the leader's). Returns
    ``[..., P]``. Must not modify its inputs. ``robust`` says whether the rule bounds what a
    minority of bad models can do (``mean`` does not).
    """

    name: ClassVar[str]
    robust: ClassVar[bool] = True

    @abstractmethod
    def aggregate(self, models: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The aggregate of stacked ``models`` (see the class)."""

    def __call__(self, models: torch.Tensor | Sequence[torch.Tensor],
                 weights: torch.Tensor | Sequence[float]) -> torch.Tensor:
        """``aggregate``, also for a list of equally shaped flat models and a list of weights."""
        if not isinstance(models, torch.Tensor):
            if not models:
                raise ValueError("no models to aggregate")
            if any(m.shape != models[0].shape for m in models):
                raise ValueError("models of different shapes cannot be aggregated")
            models = torch.stack([m.to(models[0].device) for m in models])
        weights = torch.as_tensor(weights, dtype=torch.float64, device=models.device)
        if models.dim() < 2 or weights.shape != models.shape[:-1]:
            raise ValueError(f"{tuple(weights.shape)} weights for models of shape {tuple(models.shape)}: give one "
                             "weight per model")
        if bool((weights < 0).any()) or not bool((weights.sum(-1) > 0).all()):
            raise ValueError("weights must be non-negative, and at least one positive")
        with torch.no_grad():
            return self.aggregate(models, weights)

    def __str__(self) -> str:
        return self.name


def register_rule(name: str) -> Callable[[type[AggregationRule]], type[AggregationRule]]:
    """Class decorator: register an aggregation rule under ``name`` (its constructor takes the
    name's ``:``-separated arguments)."""

    def add(cls: type[AggregationRule]) -> type[AggregationRule]:
        cls.name = name
        return RULES.add(name, cls)

    return add


def get_rule(text: str) -> AggregationRule:
    """The rule ``text`` names, with its arguments (``trimmed-mean:1``); ConfigError if unknown or
    badly written."""
    spec = parse_rule(text)
    cls = RULES.get(spec.name)
    try:
        return cls(*spec.args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"aggregation rule {text!r}: {exc}") from None


def normalised(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weights`` divided by their sum over the last dimension, in ``dtype``."""
    return (weights / weights.sum(-1, keepdim=True)).to(dtype)


def pairwise_sq_distances(models: torch.Tensor, block_elements: int = 1 << 22) -> torch.Tensor:
    """``[..., K, K]`` squared Euclidean distances between the rows of ``models`` ``[..., K, P]``:
    from the Gram matrix of the rows' differences to row 0 (small numbers, so little cancellation),
    accumulated in float64 over blocks of columns (memory stays bounded for large states)."""
    k, p = models.shape[-2], models.shape[-1]
    gram = models.new_zeros(*models.shape[:-2], k, k, dtype=torch.float64)
    step = max(1, block_elements // max(1, models[..., 0, 0].numel() * k))
    for start in range(0, p, step):
        part = models[..., start:start + step]
        part = (part - part[..., :1, :]).double()
        gram += part @ part.transpose(-1, -2)
    norms = gram.diagonal(dim1=-2, dim2=-1)
    return (norms.unsqueeze(-1) + norms.unsqueeze(-2) - 2 * gram).clamp_min(0)


def distances_to_own(models: torch.Tensor, block_elements: int = 1 << 22) -> torch.Tensor:
    """``[..., K - 1]``: the Euclidean distance of each of rows 1.. of ``models`` ``[..., K, P]``
    to row 0, accumulated in float64 over blocks of columns (no ``[K, P]`` copy is made)."""
    k, p = models.shape[-2], models.shape[-1]
    total = models.new_zeros(*models.shape[:-2], k - 1, dtype=torch.float64)
    step = max(1, block_elements // max(1, models[..., 0, 0].numel() * k))
    for start in range(0, p, step):
        part = models[..., start:start + step]
        total += torch.linalg.vector_norm(part[..., 1:, :] - part[..., :1, :], dim=-1, dtype=torch.float64).square()
    return total.sqrt()
