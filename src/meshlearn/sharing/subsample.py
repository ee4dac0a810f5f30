"""Random subsampling (DecentralizePy's SubSampling): a random share of the model's values, at
positions drawn from the run's seed, the sender and the iteration, so no positions are sent."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.sharing.base import Shared, Sharing, expect, finite, register_sharing, share_count

SALT = 0x5AB5  # keeps these draws apart from the run's other seeded draws


@register_sharing
class Subsample(Sharing):
    """An ``alpha`` share of the values, at positions every receiver draws again itself."""

    name = "subsample"

    def __init__(self, numel: int, dtype: torch.dtype, seed: int, alpha: float):
        super().__init__(numel, dtype, seed)
        self.alpha, self.count = alpha, share_count(alpha, numel)

    def positions(self, sender: int, iteration: int) -> torch.Tensor:
        """The sorted positions ``sender`` shares at ``iteration``."""
        draw = np.random.default_rng([self.seed, SALT, sender, iteration]).choice(self.numel, self.count, replace=False)
        return torch.from_numpy(np.sort(draw))

    def encode(self, vector: torch.Tensor, sender: int, iteration: int) -> dict[str, torch.Tensor]:
        return {"values": vector.detach().cpu()[self.positions(sender, iteration)]}

    def decode(self, tensors: dict[str, torch.Tensor], sender: int, iteration: int) -> Shared:
        return self.decode_partial(tensors, {"values": torch.ones(self.count, dtype=torch.bool)}, sender, iteration)

    def decode_partial(self, tensors: dict[str, torch.Tensor], present: dict[str, torch.Tensor], sender: int,
                       iteration: int) -> Shared:
        """The values that arrived, at their seeded positions."""
        expect(tensors, {"values": (self.dtype, (self.count,))})
        positions, arrived = self.positions(sender, iteration), present["values"]
        values = torch.zeros(self.numel, dtype=self.dtype)
        values[positions[arrived]] = finite(tensors["values"][arrived])
        mask = torch.zeros(self.numel, dtype=torch.bool)
        mask[positions[arrived]] = True
        unsure = None
        if not bool(arrived.all()):
            unsure = torch.zeros(self.numel, dtype=torch.bool)
            unsure[positions[~arrived]] = True
        return Shared(values, mask, unsure)

    def __str__(self) -> str:
        return f"subsample:{self.alpha:g}"
