"""Top-k sharing (DecentralizePy's TopK, a partial model): the values that changed most since the
node's last average, with their positions."""

from __future__ import annotations

import torch

from meshlearn.sharing.base import (
    SparseSharing,
    encode_sparse,
    largest,
    register_sharing,
    share_count,
)


@register_sharing
class TopK(SparseSharing):
    """The ``alpha`` share of the values whose change since the last average (the local steps'
    work) is largest in magnitude, with their positions (``SparseSharing``)."""

    name = "topk"

    state_fields = ("reference",)

    def __init__(self, numel: int, dtype: torch.dtype, seed: int, alpha: float):
        super().__init__(numel, dtype, seed)
        self.alpha, self.count = alpha, share_count(alpha, numel)
        self.reference: torch.Tensor | None = None

    def start(self, state: torch.Tensor) -> None:
        self.reference = state.detach().to("cpu", copy=True)

    def positions(self, vector: torch.Tensor) -> torch.Tensor:
        """The sorted positions of the largest changes of ``vector`` since the last average."""
        change = vector if self.reference is None else vector - self.reference
        return largest(change.abs(), self.count)

    def encode(self, vector: torch.Tensor, sender: int, iteration: int) -> dict[str, torch.Tensor]:
        vector = vector.detach().cpu()
        return encode_sparse(vector, self.positions(vector), self.lossy)

    def averaged(self, state: torch.Tensor) -> None:
        if self.reference is None:
            self.reference = state.detach().to("cpu", copy=True)
        else:
            self.reference.copy_(state.detach())

    def __str__(self) -> str:
        return f"topk:{self.alpha:g}"
