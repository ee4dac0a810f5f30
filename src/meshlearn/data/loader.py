"""Mini-batches from one node's shard, reshuffled (seeded) every epoch."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.checkpoint import Stateful
from meshlearn.data.datasets import Dataset


def loader_seed(run_seed: int, rank: int) -> int:
    """The seed of node ``rank``'s batch order in a run seeded ``run_seed`` (every engine draws the same)."""
    return run_seed * 1000 + rank


class ShardLoaders(Stateful):
    """Endless mini-batches of many nodes' shards, drawn together. Each node reshuffles its shard
    every epoch with its own seeded generator, and a batch never spans two epochs; a step for all
    nodes costs a few array operations (plus a shuffle for each node starting an epoch), not a
    call per node. ``ShardLoader`` is this for one node, so every engine draws the same batches."""

    state_fields = ("generators", "epochs", "samples_seen", "_orders", "_pos")

    def __init__(self, shards: list[np.ndarray], batch_size: int, seeds: list[int]):
        self.shards = [np.asarray(shard, dtype=np.int64) for shard in shards]
        self.sizes = np.array([len(shard) for shard in self.shards], dtype=np.int64)
        if len(self.sizes) == 0 or (self.sizes == 0).any():
            raise ValueError("a node's shard is empty")
        self.batch_sizes = np.minimum(batch_size, self.sizes)
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.epochs = np.zeros(len(self.shards), dtype=np.int64)
        self.samples_seen = np.zeros(len(self.shards), dtype=np.int64)
        self._orders = np.zeros((len(self.shards), int(self.sizes.max())), dtype=np.int64)  # row k: node k's epoch order
        self._pos = np.zeros(len(self.shards), dtype=np.int64)
        for node in range(len(self.shards)):
            self._shuffle(node)

    def _shuffle(self, node: int) -> None:
        size = int(self.sizes[node])
        order = torch.randperm(size, generator=self.generators[node]).numpy() if size > 1 else np.zeros(1, np.int64)
        self._orders[node, :size] = self.shards[node][order]
        self._pos[node] = 0

    def node_state(self, node: int) -> dict[str, np.ndarray]:
        """Node ``node``'s place in its endless stream, as arrays of its own (``set_node_state`` puts it
        back): its generator, this epoch's order, and (epochs, samples seen, position in the epoch)."""
        size = int(self.sizes[node])
        return {"generator": self.generators[node].get_state().numpy().copy(),
                "order": self._orders[node, :size].copy(),
                "place": np.array([self.epochs[node], self.samples_seen[node], self._pos[node]], dtype=np.int64)}

    def set_node_state(self, node: int, state: dict[str, np.ndarray]) -> None:
        """Node ``node`` from where ``node_state`` left it (a client drawn again takes its stream on)."""
        size = int(self.sizes[node])
        order, place = state["order"], state["place"]
        if order.shape != (size,) or place.shape != (3,):
            raise ValueError(f"a stream's state of {order.shape} samples does not fit node {node}'s {size}")
        self.generators[node].set_state(torch.from_numpy(np.ascontiguousarray(state["generator"])))
        self._orders[node, :size] = order
        self.epochs[node], self.samples_seen[node], self._pos[node] = (int(value) for value in place)

    def next(self, nodes: np.ndarray | list[int] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """The training-set indices of the next batch of every node (or of ``nodes``), grouped by
        batch size (usually one group; an epoch's last batch may be short): (the group's nodes,
        their indices [n, size]) per group, in the order of each group's first node."""
        nodes = np.arange(len(self.shards)) if nodes is None else np.asarray(nodes, dtype=np.int64)
        ended = nodes[self._pos[nodes] >= self.sizes[nodes]]  # a new epoch: a new order (one sample: the same)
        self.epochs[ended] += 1
        self._pos[ended] = 0
        for node in ended[self.sizes[ended] > 1].tolist():
            self._shuffle(node)
        take = np.minimum(self.batch_sizes[nodes], self.sizes[nodes] - self._pos[nodes])
        starts = self._pos[nodes]
        self._pos[nodes] += take
        self.samples_seen[nodes] += take
        sizes = np.unique(take)
        groups = []
        for size in sizes:
            chosen = take == size
            members = nodes[chosen]
            columns = starts[chosen][:, None] + np.arange(size)
            groups.append((members, self._orders[members[:, None], columns]))
        if len(groups) > 1:
            groups.sort(key=lambda group: int(np.flatnonzero(nodes == group[0][0])[0]))
        return groups


class ShardLoader:
    """Endless mini-batches of one node's samples, reshuffled (seeded) every epoch; a batch never
    spans two epochs (``ShardLoaders`` for one node)."""

    def __init__(self, dataset: Dataset, indices: np.ndarray, batch_size: int, seed: int):
        self.dataset = dataset
        self.indices = torch.from_numpy(np.array(indices, dtype=np.int64))  # a copy: a Partition's parts are read-only
        if len(self.indices) == 0:
            raise ValueError("a node's shard is empty")
        self._many = ShardLoaders([np.asarray(indices)], batch_size, [seed])
        self.batch_size = int(self._many.batch_sizes[0])

    @property
    def batches(self) -> ShardLoaders:
        """The batch order's state (one node's ``ShardLoaders``: what a checkpoint keeps)."""
        return self._many

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return int(self._many.epochs[0])

    @property
    def samples_seen(self) -> int:
        """Samples drawn so far."""
        return int(self._many.samples_seen[0])

    @property
    def batches_per_epoch(self) -> int:
        """Mini-batches in one pass over the shard (the last may be smaller)."""
        return -(-len(self.indices) // self.batch_size)

    def next_indices(self) -> torch.Tensor:
        """The training-set indices of the next batch (the order ``next_batch`` follows)."""
        (_, indices), = self._many.next()
        return torch.from_numpy(indices[0])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (normalized inputs, labels) batch."""
        batch = self.next_indices()
        return self.dataset.normalize(self.dataset.train_x[batch]), self.dataset.train_y[batch]
