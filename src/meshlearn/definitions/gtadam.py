"""GT-Adam (Carnevale, Farina, Notarnicola and Notarstefano 2022, "GTAdam: Gradient Tracking with
Adaptive Momentum for Distributed Online Optimization", IEEE Transactions on Control of Network
Systems): gradient tracking whose tracked estimate of the network's average gradient feeds each
node's adaptive step.

Each node keeps a tracker ``y`` of the average gradient beside its model ``x``; ``g(x)`` is its
gradient at ``x`` (one local step's batch)::

    y_t = (W y_{t-1}) + g(x_t) - g(x_{t-1})        (y_0 = g(x_0))
    x_{t+1} = W x_t  then one step of the run's optimizer along W y_t

so a node sends ``[x, y]`` (its model and a tracker of the parameters' width) and steps after the
merge, along the mixed tracker, with the run's own optimizer: AdamW or Adam for GT-Adam (each
node's moments are those of the tracked direction), any other elementwise one as it is. The
local steps only take the gradient (``optim.GradientInbox``): the model moves once, after the merge.
The paper feeds its Adam the node's tracker ``y_t`` before the mix and bounds the second moment;
this feeds the mixed ``W y_t``, one exchange fresher, and bounds nothing (AdamW's ``eps`` only):
that is what makes the complete graph's step exactly the one model's.

What it assumes: doubly stochastic weights (the topology's Metropolis-Hastings ones, or a dynamic
topology's rounds; epidemic peer sampling's are refused), under which the average of the trackers
is the average of the latest gradients; every message whole and in time (TCP, no robust rule: a
message that does not come leaves its weight with the receiver, and the trackers' average drifts
for good); one local step per iteration. Torch's Adam corrects its moments' bias; the paper's does not. On a complete
graph with equal weights every tracker after the merge is the exact average gradient, every node
takes the same step, and with equal batches the run is one model trained with their union
(``tests/test_adaptive.py`` checks it on both engines)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshlearn.definitions.base import (
    Exchange,
    RoundAlgorithm,
    State,
    one_step_refusal,
    register_algorithm,
    row_stochastic_refusal,
)
from meshlearn.definitions.needs import Needs

if TYPE_CHECKING:
    from torch import Tensor

_WEIGHTS = "the tracker follows the average gradient only under doubly stochastic weights, which {} are not"


@register_algorithm
class GradientTrackingAdam(RoundAlgorithm):
    """GT-Adam: mix ``[x, y]`` with the neighbours, then the run's optimizer steps along ``W y``."""

    name = "gtadam"
    needs = Needs(dynamic=True, byzantine=True, why_not=(
        ("lossy", _WEIGHTS.format("lost chunks' per-chunk weights")), ("robust", _WEIGHTS.format("a robust rule's"))))
    summary = ("GT-Adam, Carnevale et al. 2022: gradient tracking into each node's optimizer (AdamW), which steps "
               "along the tracked average gradient")

    @classmethod
    def conflict(cls, run) -> str | None:
        return one_step_refusal(cls.name, run) or row_stochastic_refusal(cls.name, run)

    def local_optimizer(self, optimizer: Any, state: State) -> Any:
        """The local step only records the gradient (``gradient``); the tracker's last gradient
        (``previous``) and ``W y`` of the last round (``mixed``) are kept beside it, all of the
        parameters' width. ``optimizer`` steps after each merge."""
        from meshlearn.optim import GradientInbox

        params = optimizer.params
        for name in ("gradient", "previous", "mixed"):
            state[name] = params.new_zeros(params.shape)
        self.optimizer, self._direction = optimizer, params.new_zeros(params.shape)  # the step's, a scratch copy
        return GradientInbox(optimizer, state["gradient"])

    def payload(self, own: Tensor, state: State, exchange: Exchange) -> Tensor:
        """``[x, y]`` with ``y = W y_previous + g - g_previous``: [B, S + P]."""
        gradient, previous = state["gradient"], state["previous"]
        size = own.shape[1]
        sent = own.new_empty((own.shape[0], size + gradient.shape[1]))
        sent[:, :size] = own
        sent[:, size:].copy_(state["mixed"]).add_(gradient).sub_(previous)
        previous.copy_(gradient)
        return sent

    def merge(self, own: Tensor, state: State, mixed: Tensor, exchange: Exchange) -> None:
        """The model becomes ``W x``, then steps along ``W y`` (kept for the next tracker)."""
        size = own.shape[1]
        own.copy_(mixed[:, :size])
        state["mixed"].copy_(mixed[:, size:])
        self._direction.copy_(state["mixed"])  # the optimizer may write into what it is given
        self.optimizer.step(self._direction)
