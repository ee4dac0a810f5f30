"""The algorithm interface and its registry: how a node exchanges and merges models."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

from meshlearn.config import ExperimentConfig
from meshlearn.errors import ConfigError
from meshlearn.flat import FlatState
from meshlearn.topology import Graph
from meshlearn.transport import Endpoint


@dataclass
class AlgorithmContext:
    """What an algorithm may use of its node: identity, state, link and settings."""

    rank: int
    flat: FlatState
    transport: Endpoint
    graph: Graph
    config: ExperimentConfig


class Algorithm(ABC):
    """A way of combining models across nodes, called by the node's run loop.

    ``before_local_steps`` runs once per iteration before the local SGD steps, ``before_step`` and
    ``after_step`` around each step (gossip exchanges there), and ``after_local_steps`` after
    them; it returns timings and counters for the run log. Algorithms that work alongside training (gossip)
    start their helpers in ``start`` and stop them in ``stop``.
    """

    name: ClassVar[str]

    def __init__(self, ctx: AlgorithmContext):
        self.ctx = ctx

    def start(self) -> None:
        """Called once the transport is connected, before the first iteration."""

    def before_local_steps(self, iteration: int) -> None:
        """Called at the start of each iteration, before the local steps."""

    def before_step(self) -> None:
        """Called before each local SGD step (gossip publishes and may start a fetch here)."""

    def after_step(self, loss: float) -> None:
        """Called after each local SGD step with its loss (gossip merges a fetched peer here)."""

    @abstractmethod
    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        """Exchange and update the node's state for this iteration (``train_loss``: mean of its steps)."""

    def stop(self) -> None:
        """Called once after the last iteration, before the transport closes."""


ALGORITHMS: dict[str, type[Algorithm]] = {}


class LocalOnly(Algorithm):
    """No exchange: each node trains alone (a baseline, or a node whose models a service moves)."""

    name = "local"

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        return {}


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator adding an algorithm to the registry under ``cls.name``."""
    ALGORITHMS[cls.name] = cls
    return cls


register_algorithm(LocalOnly)


def make_algorithm(name: str, ctx: AlgorithmContext) -> Algorithm:
    """Build a registered algorithm by name."""
    cls: Callable[[AlgorithmContext], Algorithm] | None = ALGORITHMS.get(name)
    if cls is None:
        raise ConfigError(f"unknown algorithm {name!r}: choose one of {', '.join(sorted(ALGORITHMS))}")
    return cls(ctx)
