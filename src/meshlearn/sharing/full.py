"""Full sharing: the whole model, as it is (today's exchange, and the reference for the others)."""

from __future__ import annotations

import torch

from meshlearn.sharing.base import Shared, Sharing, expect, finite, register_sharing


@register_sharing
class FullSharing(Sharing):
    """Every value of the model, in its own dtype."""

    name = "full"

    def encode(self, vector: torch.Tensor, sender: int, iteration: int) -> dict[str, torch.Tensor]:
        return {"values": vector.detach().to("cpu", copy=True)}

    def decode(self, tensors: dict[str, torch.Tensor], sender: int, iteration: int) -> Shared:
        expect(tensors, {"values": (self.dtype, (self.numel,))})
        return Shared(finite(tensors["values"]))
