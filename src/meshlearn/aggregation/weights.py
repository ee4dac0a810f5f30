"""How much each model counts in an aggregation: pure functions from what is known of each model."""

from __future__ import annotations

from typing import Sequence


def equal(count: int) -> list[float]:
    """Every model the same."""
    return [1.0] * count


def by_samples(samples: Sequence[int]) -> list[float]:
    """In proportion to the samples each model was trained on (FedAvg); a model of 0 samples counts as 1."""
    return [float(max(1, s)) for s in samples]


def by_staleness(samples: Sequence[int], behind: Sequence[float]) -> list[float]:
    """Sample-weighted and discounted by staleness: ``samples / (1 + behind)``, where ``behind``
    is how many rounds old a model is (FedAsync's polynomial rule, Xie et al. 2019). A member
    that stalls or dies stops dragging the others back long before it is declared lost."""
    return [w / (1.0 + b) for w, b in zip(by_samples(samples), behind)]
