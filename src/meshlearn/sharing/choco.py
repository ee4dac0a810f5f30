"""CHOCO-SGD (Koloskova, Stich and Jaggi 2019): compressed gossip with error feedback.

Every node keeps a public estimate of its own model and of each neighbour's. It picks the top
``alpha`` share of the difference between its model and its own estimate; its estimate takes that
change in, and so do the estimates everyone keeps of it, so what compression leaves out now is
sent later. The node then steps ``gamma`` of the way along the Metropolis-Hastings average of the
estimates: ``x_i += gamma * sum_j w_ij (xhat_j - xhat_i)``. Estimates start at zero, as in the paper.

A message carries the estimate's new values at the positions that changed (the paper writes the
change; for a receiver that saw every earlier update the two are the same, bit for bit). So an
update that is lost (a deadline missed, a UDP chunk lost) leaves the receiver's estimate out of
step only where it would have changed: those values (all of them when the whole update is lost,
whose positions nobody knows) are left out of the average, as if that neighbour had not sent
them, until the sender sends them again.
"""

from __future__ import annotations

import logging

import torch

from meshlearn.sharing.base import (
    Shared,
    SparseSharing,
    encode_sparse,
    largest,
    register_sharing,
    share_count,
)
from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)


@register_sharing
class Choco(SparseSharing):
    """CHOCO-SGD with top-``alpha`` compression and consensus step ``gamma``."""

    name = "choco"
    mixes = True

    state_fields = ("own", "estimates", "stale")

    def __init__(self, numel: int, dtype: torch.dtype, seed: int, alpha: float, gamma: float = 0.5):
        super().__init__(numel, dtype, seed)
        self.alpha, self.gamma, self.count = alpha, gamma, share_count(alpha, numel)
        self.own = torch.zeros(numel, dtype=dtype)  # this node's public estimate
        self.estimates: dict[int, torch.Tensor] = {}  # the neighbours' public estimates
        self.stale: dict[int, torch.Tensor] = {}  # per neighbour, where its estimate is out of step (once lost)
        self._warnings = SparseLog(log)

    def encode(self, vector: torch.Tensor, sender: int, iteration: int) -> dict[str, torch.Tensor]:
        """The node's estimate, which takes in the top share of its difference to ``vector``, at
        the positions that changed (call it once per iteration)."""
        difference = vector.detach().cpu() - self.own
        positions = largest(difference.abs(), self.count)
        self.own[positions] += difference[positions]
        return encode_sparse(self.own, positions, self.lossy)

    def mix_(self, state: torch.Tensor, weights: dict[int, float], received: dict[int, Shared]) -> list[int]:
        """In place: the estimates take in what arrived, then ``state`` steps toward the weighted
        average of the estimates (``weights``: every neighbour's Metropolis-Hastings weight), each
        value over the neighbours whose estimate of it is in step. Returns the neighbours none of
        whose update arrived (every value of theirs is out of step until sent again)."""
        missed = []
        step = torch.zeros_like(self.own)
        for sender, weight in sorted(weights.items()):
            estimate = self.estimates.setdefault(sender, torch.zeros_like(self.own))
            share = received.get(sender)
            if share is None:
                missed.append(sender)
                self.stale[sender] = torch.ones(self.numel, dtype=torch.bool)
            else:
                self._take_in(sender, estimate, share)
            term = (estimate - self.own) * weight
            if sender in self.stale:
                term.masked_fill_(self.stale[sender], 0.0)
            if not bool(torch.isfinite(term).all()):  # finite estimates can still differ past float's range
                self._warnings.warning(f"overflow-{sender}", "choco: the estimate of node %d is too far from this "
                                       "node's to average; it is left out this round", sender)
                continue
            step += term
        if not bool(torch.isfinite(step).all()):
            self._warnings.warning("overflow", "choco: the neighbours' estimates add up past float's range; this "
                                   "round's step is skipped")
            return missed
        with torch.no_grad():
            state.add_(step.to(state.device), alpha=self.gamma)
        return missed

    def _take_in(self, sender: int, estimate: torch.Tensor, share: Shared) -> None:
        """``sender``'s estimate takes the values that arrived; what may have been lost is out of
        step, what arrived is in step again."""
        if share.mask is None:
            estimate.copy_(share.values)
            self.stale.pop(sender, None)
            return
        estimate[share.mask] = share.values[share.mask]
        stale = self.stale.get(sender)
        if share.unsure is not None and bool(share.unsure.any()):
            stale = self.stale.setdefault(sender, torch.zeros(self.numel, dtype=torch.bool))
            stale |= share.unsure
        if stale is not None:
            stale[share.mask] = False
            if not bool(stale.any()):
                del self.stale[sender]

    def __str__(self) -> str:
        return f"choco:{self.alpha:g}:{self.gamma:g}"
