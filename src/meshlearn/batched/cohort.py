"""Clients that exist while drawn: the batched engine's path for a cross-device population.

A FedAvg round whose clients keep nothing between rounds needs no model for a client that is not
drawn: the round's cohort is materialized from the server's model into a few rows, trained, averaged
and forgotten. Memory then grows with the cohort, not the population (100,000 clients cost what
1,000 do). What a client must carry to its next draw (its place in its batch stream, its own
momentum) lives in a sparse store (``clientstate.ClientStates``), for the clients that have any.

This module holds the path's data side: where a drawn client's samples come from
(``SplitSamples``: its part of a data set, by index, no copy; ``PopulationSamples``: a generated
population's user, made when drawn), its batches in the order its process-engine twin draws them
(``CohortBatches``), and whether a run can take the path (``cohort_refusal``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from meshlearn.batched.clientstate import ClientStates
from meshlearn.batched.models import Batch
from meshlearn.config import ExperimentConfig
from meshlearn.data import Dataset, ShardLoaders, loader_seed

SERVER_ROW = 0  # the stacked row holding the server's model; the cohort's rows follow it
COHORT_ALGORITHMS = ("fedavg",)  # the algorithms the path runs (their rules: definitions/<name>.py)


class ClientSamples(Protocol):
    """Where a drawn client's training samples come from."""

    sizes: np.ndarray  # training samples of each client of the population

    def begin(self, clients: Sequence[int]) -> None:
        """The round's cohort is ``clients``: what their batches read from now on."""

    def begin_step(self) -> None:
        """A step's batches are about to be read (those of the step before are used up)."""

    def batch(self, clients: np.ndarray, picks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs (as the model reads them) and targets of ``picks`` [n, b]: row j the positions,
        in client ``clients[j]``'s own samples, of its batch."""


class SplitSamples:
    """Clients' parts of one data set (``parts[k]``: client k's sample indices, a view or an array
    each; a ``Partition``): a batch is read from the data set by index, nothing is copied per client,
    into buffers kept from step to step (a step allocates no batch: ``begin_step`` hands them out
    again)."""

    def __init__(self, dataset: Dataset, parts: Any):
        self.dataset, self.parts = dataset, parts
        sizes = getattr(parts, "sizes", None)
        self.sizes = np.asarray(sizes if sizes is not None else [len(part) for part in parts], dtype=np.int64)
        self._raw: torch.Tensor | None = None  # the samples as stored, then as the model reads them
        self._read: torch.Tensor | None = None
        self._used = 0  # samples of the buffers this step's batches took so far

    def begin(self, clients: Sequence[int]) -> None:
        """Nothing to prepare: every client's samples are in the data set already."""

    def begin_step(self) -> None:
        """A new step: the buffers' samples are free again (the last step's batches are used up)."""
        self._used = 0

    def _buffers(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for ``count`` more samples of this step, as stored and as read (grown when short)."""
        end = self._used + count
        if self._raw is None or len(self._raw) < end:
            shape = self.dataset.train_x.shape[1:]
            self._raw = self.dataset.train_x.new_empty((end, *shape))
            self._read = self.dataset.normalize(self._raw[:1]).new_empty((end, *shape))
        start, self._used = self._used, end
        return self._raw[start:end], self._read[start:end]

    def batch(self, clients: np.ndarray, picks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index = np.stack([self.parts[int(client)][row] for client, row in zip(clients, picks)]).reshape(-1)
        index = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        raw, read = self._buffers(len(index))
        x = self.dataset.normalize(torch.index_select(self.dataset.train_x, 0, index, out=raw), out=read)
        y = self.dataset.train_y.index_select(0, index)
        count, size = picks.shape
        return x.view(count, size, *x.shape[1:]), y.view(count, size, *y.shape[1:])


class PopulationSamples:
    """A generated population's users (``dataset.population``: ``samples(k)`` makes user k's training
    samples), each made when its round begins and forgotten when the next one does."""

    def __init__(self, dataset: Dataset):
        self.dataset, self.population = dataset, dataset.population
        self.sizes = np.asarray(self.population.sizes, dtype=np.int64)
        self._drawn: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, clients: Sequence[int]) -> None:
        self._drawn = {int(client): self.population.samples(int(client)) for client in clients}

    def begin_step(self) -> None:
        """Nothing kept from step to step: a user's batch is read from its samples."""

    def batch(self, clients: np.ndarray, picks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self._drawn[int(client)] for client in clients]
        picked = [torch.from_numpy(np.ascontiguousarray(row, dtype=np.int64)) for row in picks]
        x = self.dataset.normalize(torch.stack([x.index_select(0, k) for (x, _), k in zip(rows, picked)]).flatten(0, 1))
        y = torch.stack([y.index_select(0, k) for (_, y), k in zip(rows, picked)])
        return x.view(*picks.shape, *x.shape[1:]), y


def client_samples(dataset: Dataset, parts: Any) -> ClientSamples:
    """The population's samples: a generated population's users, or ``parts`` of ``dataset``."""
    return PopulationSamples(dataset) if getattr(dataset, "population", None) is not None else \
        SplitSamples(dataset, parts)


class CohortBatches:
    """Each drawn client's next mini-batches, exactly as its process-engine twin draws them: its own
    endless stream over its samples, reshuffled every epoch with its seed (``ShardLoaders``,
    ``loader_seed``), taken on where it left off when it was last drawn (``states``). Row ``1 + j``
    of the stacked state is the round's ``j``-th client."""

    STATE = "stream"  # the name of a client's place in its stream, in ``states``

    def __init__(self, samples: ClientSamples, batch_size: int, run_seed: int, states: ClientStates,
                 device: torch.device | str = "cpu"):
        self.samples, self.batch_size, self.run_seed = samples, batch_size, run_seed
        self.states, self.device = states, torch.device(device)
        self.clients = np.zeros(0, dtype=np.int64)
        self._loaders: ShardLoaders | None = None

    @property
    def checkpointed(self) -> ClientStates:
        """What a checkpoint keeps of the batch order: every drawn client's place."""
        return self.states

    def begin(self, clients: Sequence[int]) -> None:
        """The round's cohort: each client's stream from where it was (its first epoch's order if new)."""
        self.clients = np.asarray(clients, dtype=np.int64)
        self.samples.begin(clients)
        sizes = self.samples.sizes[self.clients]
        self._loaders = ShardLoaders([np.arange(size, dtype=np.int64) for size in sizes], self.batch_size,
                                     [loader_seed(self.run_seed, int(client)) for client in self.clients])
        for slot, client in enumerate(self.clients.tolist()):
            kept = self.states.get(client)
            if kept is not None and self.STATE + ".order" in kept:
                self._loaders.set_node_state(slot, {name.split(".", 1)[1]: array for name, array in kept.items()
                                                    if name.startswith(self.STATE + ".")})

    def end(self) -> None:
        """The round is over: each client's place in its stream kept for its next draw."""
        for slot, client in enumerate(self.clients.tolist()):
            kept = dict(self.states.get(client) or {})
            kept.update({f"{self.STATE}.{name}": array for name, array in self._loaders.node_state(slot).items()})
            self.states.put(client, kept)
        self._loaders = None

    def samples_of(self) -> list[int]:
        """Training samples of each of the round's clients."""
        return self.samples.sizes[self.clients].tolist()

    def next(self, rows: list[int] | None = None) -> list[Batch]:
        """The next batch of the clients in stacked ``rows`` (default: the whole cohort), grouped by
        batch size (an epoch's last batch may be short)."""
        slots = np.arange(len(self.clients)) if rows is None else np.asarray(rows, dtype=np.int64) - 1
        self.samples.begin_step()
        batches = []
        for members, picks in self._loaders.next(slots):
            x, y = self.samples.batch(self.clients[members], picks)
            batches.append(Batch(torch.from_numpy(members + 1).to(self.device),
                                 x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return batches


def cohort_refusal(config: ExperimentConfig, processes: int = 1) -> str | None:
    """Why ``config`` cannot run on the cohort path (None: it can): its algorithm's clients keep
    something between rounds, or the run asks for what the path does not model (a robust rule,
    bad nodes, a privacy mechanism, an optimizer other than torch-free SGD, several processes)."""
    from meshlearn.optim import parse_optimizer
    from meshlearn.privacy.mechanism import active_mechanisms

    if config.algorithm not in COHORT_ALGORITHMS:
        return f"{config.algorithm} keeps a model per node"
    if config.batched.cohort == "off":
        return "batched_cohort is off"
    fedavg = config.fedavg
    checks = (
        (fedavg.compress != "none", f"fedavg_compress {fedavg.compress} keeps error feedback per node"),
        (fedavg.fragments > 1 or fedavg.overlap, "Streaming DiLoCo's fragments and overlap keep a model per node"),
        (config.aggregation != "mean", f"aggregation {config.aggregation} judges every node's model"),
        (bool(config.attackers()), "bad nodes (byzantine) forge from a model of their own"),
        (bool(active_mechanisms(config)), "a privacy mechanism accounts per node"),
        (parse_optimizer(config.optimizer) != ("SGD", {}), f"optimizer {config.optimizer} keeps state per node"),
        (processes > 1, "torchrun splits nodes over processes"),
        (config.train_evaluate, "train_evaluate tests every node on its own shard"),
    )
    return next((why for refused, why in checks if refused), None)
