"""The batched engine's algorithm interface: how all nodes exchange and merge at once."""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from meshlearn.batched.clock import VirtualClocks
from meshlearn.batched.mixing import Links
from meshlearn.batched.network import ModelledNetwork, Traffic
from meshlearn.batched.shards import Collective, HaloPlan, Shard
from meshlearn.batched.stacked import StackedState
from meshlearn.checkpoint import Stateful
from meshlearn.config import ExperimentConfig
from meshlearn.topology import Graph


@dataclass
class BatchedContext:
    """What a batched algorithm may use: the run's settings and graph, the state of the nodes this
    process holds (``shard``: all of them, in one process), the run's directed links and the
    nodes' modelled clocks (both for every node), the links into this block (``local``), and what
    it needs of other blocks (``rows_of_others``)."""

    config: ExperimentConfig
    graph: Graph
    stacked: StackedState
    links: Links
    clocks: VirtualClocks
    shard: Shard
    local: Links
    collective: Collective
    plan: HaloPlan | None = None
    samples: list[int] = field(default_factory=list)  # training samples in each node's shard
    network: ModelledNetwork | None = None  # gathers in modelled time and counts the traffic

    def rows_to_average(self, sent: torch.Tensor | None = None) -> torch.Tensor:
        """The rows the local links' senders index: this block's, then those other blocks send
        (``sent``: this block's rows as its nodes send them, when some send other than their state)."""
        state = self.stacked.state
        if self.plan is None:
            return state
        return torch.cat([state, self.collective.exchange(state if sent is None else sent, self.plan)])


class AsyncDriver(Protocol):
    """What the batched engine does for an asynchronous algorithm, which orders the nodes' steps
    itself (in modelled time) instead of running them in lockstep."""

    def train(self, ranks: list[int]) -> dict[int, float]:
        """One local SGD step of each node of ``ranks`` (computed together); their losses."""

    def record(self, rank: int, iteration: int, now: float, columns: dict[str, Any]) -> None:
        """Node ``rank`` finished ``iteration`` at modelled time ``now``: its log columns (its
        model then, after the engine's outer step where the run has an outer optimizer, is what
        that iteration's evaluation sees and what its next steps start from)."""

    def finished(self, rank: int, now: float) -> None:
        """Node ``rank`` finished its last step at modelled time ``now``."""


class BatchedAlgorithm(Stateful, ABC):
    """A way of combining every node's model at once. A synchronous one is called by the batched
    engine after each iteration's local steps (``after_local_steps``: per-node columns for the run
    log, numpy arrays of N values, ``comm`` each node's modelled waiting time); an
    ``asynchronous`` one runs the nodes' steps itself, in modelled time (``drive``). Both count
    their traffic in ``traffic``. ``state_fields``: what a checkpoint keeps of it (``checkpoint``)."""

    name: ClassVar[str]
    asynchronous: ClassVar[bool] = False

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        self.ctx = ctx
        self.traffic = traffic

    def trainers(self, iteration: int) -> list[int] | None:
        """The nodes of this block (numbered from 0) whose local steps ``iteration`` asks for
        (None: every one); the others skip them, where the optimizer allows (``steps_rows_apart``)."""
        return None

    def local_optimizer(self, optimizer: Any) -> Any:
        """What the nodes' local steps call in place of the run's ``optimizer`` (``RoundAlgorithm.local_optimizer``):
        the optimizer itself for an algorithm that leaves the steps to it."""
        return optimizer

    def before_local_steps(self, iteration: int) -> None:
        """Called before each iteration's local steps (synchronous algorithms)."""

    def aggregated(self, iteration: int) -> tuple[int, int] | None:
        """The part [a, b) of the state ``iteration``'s exchange aggregated (an outer optimizer steps
        only it); None: all of it."""
        return None

    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        """Exchange and merge every node's model for this iteration; advance their clocks."""
        raise NotImplementedError(f"{self.name} is asynchronous: it drives its own steps")

    def drive(self, driver: AsyncDriver) -> None:
        """Run every node's steps, in modelled time (asynchronous algorithms)."""
        raise NotImplementedError(f"{self.name} runs in lockstep iterations")

    def peers_report(self) -> dict[int, dict]:
        """Per node of this block (numbered from 0) that saw any: the peers whose models it refused
        or found deviant, and those it suspects (as a process-engine node's ``peers_report``)."""
        return {}
