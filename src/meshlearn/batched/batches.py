"""Every node's next mini-batch, in the order its process-engine twin draws it."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.attacks.forge import LabelFlip
from meshlearn.batched.models import Batch
from meshlearn.data import Dataset, ShardLoaders, loader_seed


class NodeBatches:
    """Mini-batches for all nodes: node r draws from its shard with the seed a process-engine
    node r uses (``ShardLoaders``, ``loader_seed``), so both engines see the same batches in the
    same order. Nodes whose batches differ in size (an epoch's last, short batch) come in
    separate groups, since one vectorized call needs one batch size."""

    def __init__(self, dataset: Dataset, parts: list[np.ndarray], batch_size: int, run_seed: int,
                 device: torch.device | str = "cpu", first_rank: int = 0, flipped: set[int] = frozenset()):
        self.dataset = dataset
        self.flipped = flipped  # nodes (numbered from 0) that train on flipped labels (a label-flip attack)
        self.device = torch.device(device)
        # ``parts`` are the shards of nodes first_rank, first_rank + 1, ...; batches name them from 0
        self.loaders = ShardLoaders(parts, batch_size,
                                    [loader_seed(run_seed, first_rank + index) for index in range(len(parts))])

    @property
    def checkpointed(self) -> ShardLoaders:
        """What a checkpoint keeps of the batch order: every node's place in its stream."""
        return self.loaders

    def samples(self) -> list[int]:
        """Samples in each node's shard."""
        return self.loaders.sizes.tolist()

    def next(self, ranks: list[int] | None = None) -> list[Batch]:
        """The next batch of every node (or of ``ranks``), grouped by batch size (usually one group)."""
        batches = []
        for members, picks in self.loaders.next(ranks):
            count, size = picks.shape
            index = torch.from_numpy(picks.reshape(-1))
            x = self.dataset.normalize(self.dataset.train_x.index_select(0, index))  # (faster than [index])
            y = self.dataset.train_y.index_select(0, index)
            y = y.view(count, size, *y.shape[1:])
            flip = [k for k, rank in enumerate(members.tolist()) if rank in self.flipped] if self.flipped else []
            if flip:
                y = y.clone()
                y[flip] = LabelFlip.flip(y[flip], self.dataset.num_classes)
            batches.append(Batch(
                torch.from_numpy(members).to(self.device),
                x.view(count, size, *x.shape[1:]).to(self.device, non_blocking=True),
                y.to(self.device, non_blocking=True),
            ))
        return batches
