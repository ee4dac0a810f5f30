"""CHOCO-SGD (Koloskova, Stich and Jaggi 2019): compressed gossip with error feedback.

Every node keeps a public estimate of its own model and of each neighbour's. It sends the top
``alpha`` share of the difference between its model and its own estimate, and everyone who
receives it (itself included) adds it to that estimate, so what compression leaves out now is
sent later. The node then steps ``gamma`` of the way along the Metropolis-Hastings average of the
estimates: ``x_i += gamma * sum_j w_ij (xhat_j - xhat_i)``. Estimates start at zero, as in the paper.

The estimates must see every update: a neighbour whose update is missed (a deadline) is out of
step for good, so it is left out of the average from then on (and the run log says so).
"""

from __future__ import annotations

import logging

import torch

from meshlearn.sharing.base import (
    Shared,
    Sharing,
    decode_sparse,
    encode_sparse,
    largest,
    register_sharing,
    share_count,
    sparse_bytes,
)

log = logging.getLogger(__name__)


@register_sharing
class Choco(Sharing):
    """CHOCO-SGD with top-``alpha`` compression and consensus step ``gamma``."""

    name = "choco"
    mixes = True

    def __init__(self, numel: int, dtype: torch.dtype, seed: int, alpha: float, gamma: float = 0.5):
        super().__init__(numel, dtype, seed)
        self.alpha, self.gamma, self.count = alpha, gamma, share_count(alpha, numel)
        self.own = torch.zeros(numel, dtype=dtype)  # this node's public estimate
        self.estimates: dict[int, torch.Tensor] = {}  # the neighbours' public estimates
        self.out_of_step: set[int] = set()

    def encode(self, vector: torch.Tensor, sender: int, iteration: int) -> dict[str, torch.Tensor]:
        """The compressed difference to the node's own estimate; the estimate takes it in (call it
        once per iteration)."""
        difference = vector.detach().cpu() - self.own
        positions = largest(difference.abs(), self.count)
        payload = encode_sparse(difference, positions)
        self.own[positions] += payload["values"]
        return payload

    def decode(self, tensors: dict[str, torch.Tensor], sender: int, iteration: int) -> Shared:
        return decode_sparse(tensors, self.numel, self.dtype, self.count)

    def mix_(self, state: torch.Tensor, weights: dict[int, float], received: dict[int, Shared]) -> list[int]:
        """In place: the estimates take in what arrived, then ``state`` steps toward the weighted
        average of the estimates of the neighbours still in step (``weights``: every neighbour's
        Metropolis-Hastings weight). Returns the neighbours that fell out of step now."""
        lost = []
        step = torch.zeros_like(self.own)
        for sender, weight in sorted(weights.items()):
            if sender in self.out_of_step:
                continue
            if sender not in received:
                self.out_of_step.add(sender)
                lost.append(sender)
                continue
            estimate = self.estimates.setdefault(sender, torch.zeros_like(self.own)) + received[sender].values
            term = (estimate - self.own) * weight
            if not bool(torch.isfinite(term).all()):  # finite updates can still add up past float's range
                self.out_of_step.add(sender)
                lost.append(sender)
                log.warning("choco: the estimate of node %d overflowed; it is left out from now on", sender)
                continue
            self.estimates[sender] = estimate
            step += term
        if not bool(torch.isfinite(step).all()):
            log.warning("choco: the neighbours' estimates add up past float's range; this round's step is skipped")
            return lost
        with torch.no_grad():
            state.add_(step.to(state.device), alpha=self.gamma)
        return lost

    def wire_bytes(self) -> int:
        return sparse_bytes(self.count, self.numel, torch.empty((), dtype=self.dtype).element_size())

    def __str__(self) -> str:
        return f"choco:{self.alpha:g}:{self.gamma:g}"
