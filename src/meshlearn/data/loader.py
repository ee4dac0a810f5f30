"""Mini-batches from one node's shard, reshuffled (seeded) every epoch."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.data.datasets import Dataset


def loader_seed(run_seed: int, rank: int) -> int:
    """The seed of node ``rank``'s batch order in a run seeded ``run_seed`` (every engine draws the same)."""
    return run_seed * 1000 + rank


class ShardLoader:
    """Endless mini-batches of a node's samples; a batch never spans two epochs."""

    def __init__(self, dataset: Dataset, indices: np.ndarray, batch_size: int, seed: int):
        self.dataset = dataset
        self.indices = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if len(self.indices) == 0:
            raise ValueError("a node's shard is empty")
        self.batch_size = min(batch_size, len(self.indices))
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.samples_seen = 0
        self._order = self.indices[torch.randperm(len(self.indices), generator=self.generator)]
        self._pos = 0

    @property
    def batches_per_epoch(self) -> int:
        """Mini-batches in one pass over the shard (the last may be smaller)."""
        return -(-len(self.indices) // self.batch_size)

    def next_indices(self) -> torch.Tensor:
        """The training-set indices of the next batch (the order ``next_batch`` follows)."""
        if self._pos >= len(self._order):
            self.epoch += 1
            self._order = self.indices[torch.randperm(len(self.indices), generator=self.generator)]
            self._pos = 0
        batch = self._order[self._pos:self._pos + self.batch_size]
        self._pos += len(batch)
        self.samples_seen += len(batch)
        return batch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (normalized inputs, labels) batch."""
        batch = self.next_indices()
        return self.dataset.normalize(self.dataset.train_x[batch]), self.dataset.train_y[batch]
