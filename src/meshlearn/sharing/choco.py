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

A value top-k does not pick again would stay out for good, so each message also carries a
rotating window of the estimate's values (``WINDOW_SHARE`` of them, at positions the iteration
sets: nothing more to send or to check), which puts those positions back in step: every position
is sent at least once every ``ceil(1 / WINDOW_SHARE)`` messages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from meshlearn.layout import TensorLayout
from meshlearn.sharing.base import (
    Shared,
    SparseSharing,
    encode_sparse,
    expect,
    finite,
    largest,
    register_sharing,
    share_count,
)
from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)

# The share of the estimate's values each message also carries as they are, a window rotating
# over the model: 1% costs 4 bytes per 100 values (0.04P bytes at float32, 5% more than choco:0.1's
# pairs over UDP) and puts every position back in step within 100 messages.
WINDOW_SHARE = 0.01


@dataclass
class ChocoShared(Shared):
    """A CHOCO-SGD neighbour's update as received: ``Shared`` for the values that changed, and the
    values of its window that arrived (``window``: their positions, ``window_values``: the
    sender's estimate there), which put those positions back in step."""

    window: torch.Tensor | None = None
    window_values: torch.Tensor | None = None


def window_positions(numel: int, size: int, iteration: int) -> torch.Tensor:
    """The ``size`` positions of a ``numel``-value model whose values the message of ``iteration``
    carries as they are: ``[size * iteration, size * (iteration + 1))`` around the model, so
    consecutive messages cover every position in turn."""
    return (torch.arange(size) + (size * iteration) % numel) % numel


@register_sharing
class Choco(SparseSharing):
    """CHOCO-SGD with top-``alpha`` compression and consensus step ``gamma``."""

    name = "choco"
    mixes = True

    state_fields = ("own", "estimates", "stale")

    def __init__(self, numel: int, dtype: torch.dtype, seed: int, alpha: float, gamma: float = 0.5):
        super().__init__(numel, dtype, seed)
        self.alpha, self.gamma, self.count = alpha, gamma, share_count(alpha, numel)
        self.window_size = share_count(WINDOW_SHARE, numel)  # values of the estimate each message carries as they are
        self.own = torch.zeros(numel, dtype=dtype)  # this node's public estimate
        self.estimates: dict[int, torch.Tensor] = {}  # the neighbours' public estimates
        self.stale: dict[int, torch.Tensor] = {}  # per neighbour, where its estimate is out of step (once lost)
        self._warnings = SparseLog(log)

    def encode(self, vector: torch.Tensor, sender: int, iteration: int) -> dict[str, torch.Tensor]:
        """The node's estimate, which takes in the top share of its difference to ``vector``, at
        the positions that changed, and its window of ``iteration`` (call it once per iteration)."""
        difference = vector.detach().cpu() - self.own
        positions = largest(difference.abs(), self.count)
        self.own[positions] += difference[positions]
        return self._message(self.own, positions, iteration)

    def _message(self, estimate: torch.Tensor, positions: torch.Tensor, iteration: int) -> dict[str, torch.Tensor]:
        """The tensors of a message: ``estimate`` at ``positions`` (``encode_sparse``) and its
        window of ``iteration``; ``lossy``, the window in bytes after the pairs (so a chunk of a
        message cut at multiples of 8 bytes holds whole pairs, then whole values)."""
        window = estimate[window_positions(self.numel, self.window_size, iteration)]
        return {**encode_sparse(estimate, positions, self.lossy),
                "window": window.view(torch.uint8) if self.lossy else window}

    def layout(self) -> TensorLayout:
        if getattr(self, "_layout", None) is None:
            self._layout = TensorLayout.of(self._message(torch.zeros(self.numel, dtype=self.dtype),
                                                         torch.arange(self.count), 0))
        return self._layout

    def decode(self, tensors: dict[str, torch.Tensor], sender: int, iteration: int) -> ChocoShared:
        """The values that changed (``SparseSharing``) and the window, all of it arrived."""
        changed, window = self._split(tensors)
        return self._with_window(super().decode(changed, sender, iteration), window,
                                 torch.ones(window.numel(), dtype=torch.bool), iteration)

    def decode_partial(self, tensors: dict[str, torch.Tensor], present: dict[str, torch.Tensor], sender: int,
                       iteration: int) -> ChocoShared | None:
        """The (position, value) pairs that arrived whole (``SparseSharing``) and the window's
        values that arrived, each at its own position."""
        changed, window = self._split(tensors)
        share = super().decode_partial(changed, present, sender, iteration)
        return None if share is None else self._with_window(share, window, present["window"], iteration)

    def _split(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The message's changed values and its window, checked for size and type; ValueError
        otherwise."""
        if "window" not in tensors:
            raise ValueError("the choco message has no 'window' tensor (the sender's estimate at rotating positions): "
                             "run the same meshlearn version on every node")
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        shape = (torch.uint8, (self.window_size * itemsize,)) if self.lossy else (self.dtype, (self.window_size,))
        expect({"window": tensors["window"]}, {"window": shape})
        return {name: tensor for name, tensor in tensors.items() if name != "window"}, tensors["window"]

    def _with_window(self, share: Shared, window: torch.Tensor, arrived: torch.Tensor, iteration: int) -> ChocoShared:
        """``share`` and the values of ``window`` that ``arrived`` (bool per element: per byte when
        ``lossy``, where a value arrived when all its bytes did), at the window's positions for
        ``iteration``."""
        if self.lossy:
            window = window.clone().view(self.dtype)
            arrived = arrived.view(self.window_size, -1).all(1)
        positions = window_positions(self.numel, self.window_size, iteration)[arrived]
        values = finite(window[arrived], "the window's values")
        return ChocoShared(share.values, share.mask, share.unsure, positions, values)

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
        """``sender``'s estimate takes the values that arrived (those that changed, then its
        window's); what may have been lost is out of step, what arrived is in step again."""
        if share.mask is None:
            estimate.copy_(share.values)
            self.stale.pop(sender, None)
            return
        estimate[share.mask] = share.values[share.mask]
        window = share.window if isinstance(share, ChocoShared) else None
        if window is not None:
            estimate[window] = share.window_values
        stale = self.stale.get(sender)
        if share.unsure is not None and bool(share.unsure.any()):
            stale = self.stale.setdefault(sender, torch.zeros(self.numel, dtype=torch.bool))
            stale |= share.unsure
        if stale is not None:
            stale[share.mask] = False
            if window is not None:
                stale[window] = False
            if not bool(stale.any()):
                del self.stale[sender]

    def __str__(self) -> str:
        return f"choco:{self.alpha:g}:{self.gamma:g}"
