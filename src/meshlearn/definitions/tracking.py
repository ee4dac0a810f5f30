"""Gradient tracking, as DSGT (Pu and Nedić 2021, "Distributed stochastic gradient tracking
methods", Mathematical Programming 187): D-PSGD that follows the average gradient instead of the
node's own, for data that differs between nodes (non-IID).

DSGT keeps a tracker ``y`` of the network's average gradient beside the model ``x``::

    x <- W (x - lr * y)          y <- W y + g(x_new) - g(x_old)          (y starts at g(x_0))

Here the local steps give the update ``u = x_after - x_before`` (``-lr * g`` for one SGD step; with
several local steps or momentum, their combined update), and the tracker ``d`` is kept in update
units (``d = -lr * y``)::

    d <- (W d)_previous + u - u_previous          x <- W (x + d)

so each round a node sends ``x + d`` and ``d`` (twice a model) and its model moves only by the
tracked update: its own update enters once, through ``d``. The weights are the topology's
Metropolis-Hastings ones (doubly stochastic), or those of a dynamic topology's rounds (epidemic
peer sampling's, row-stochastic only, are refused). A message that does not come in time leaves
its weight with the receiver (D-PSGD's rule): the trackers' average then drifts from the average
update for good, so the tracker is exact only where every message arrives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlearn.definitions.base import (
    Exchange,
    RoundAlgorithm,
    State,
    register_algorithm,
    row_stochastic_refusal,
)
from meshlearn.definitions.needs import Needs

if TYPE_CHECKING:
    from torch import Tensor


@register_algorithm
class GradientTracking(RoundAlgorithm):
    """DSGT: average ``x + d`` and the tracker ``d`` with the neighbours; step along the tracked update."""

    name = "tracking"
    needs = Needs(dynamic=True, byzantine=True, why_not=(
        ("lossy", ("the tracker follows the average update only under doubly stochastic weights, which lost "
                   "chunks' per-chunk weights are not")),
        ("robust", ("the tracker follows the average update only under doubly stochastic weights, which a "
                    "robust rule's are not"))))
    summary = "gradient tracking as DSGT, Pu and Nedić 2021: D-PSGD along the tracked average update, for non-IID data"

    @classmethod
    def conflict(cls, run) -> str | None:
        return row_stochastic_refusal(cls.name, run)

    def begin(self, own: Tensor) -> State:
        """The model the local steps started from, the last update, and ``W d`` of the last round (zero)."""
        return {"start": own.clone(), "update": own.new_zeros(own.shape), "mixed": own.new_zeros(own.shape)}

    def payload(self, own: Tensor, state: State, exchange: Exchange) -> Tensor:
        """``[x + d, d]`` with ``d = W d_previous + u - u_previous``: [B, 2P]."""
        start, update, mixed = state["start"], state["update"], state["mixed"]
        size = own.shape[1]
        sent = own.new_empty((own.shape[0], 2 * size))
        tracker = sent[:, size:]
        tracker.copy_(mixed).sub_(update)  # W d - u_previous
        update.copy_(own).sub_(start)  # this round's update
        tracker.add_(update)
        sent[:, :size] = start + tracker
        return sent

    def merge(self, own: Tensor, state: State, mixed: Tensor, exchange: Exchange) -> None:
        """The new model is ``W (x + d)``; ``W d`` is kept for the next round's tracker."""
        size = own.shape[1]
        state["mixed"].copy_(mixed[:, size:])
        state["start"].copy_(mixed[:, :size])
        own.copy_(state["start"])
