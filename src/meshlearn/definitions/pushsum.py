"""Push-sum, as Stochastic Gradient Push (Assran et al. 2019, "Stochastic Gradient Push for
Distributed Deep Learning", ICML): averaging over directed and time-varying graphs.

Each node i keeps a numerator ``x`` (a model) and a push-sum weight ``w`` (1 at the start); the
model it trains and is evaluated on is the de-biased ``z = x / w``. After its local steps it adds
the steps' update to ``x`` (SGP's ``x <- x - lr * grad(z)``), then pushes a share of ``(x, w)`` to
each peer of the round and keeps one: with ``d`` peers, ``1 / (d + 1)`` each. (Setting ``step:
model`` moves the de-biased model by the update instead: ``x <- x + w * update``.) The weights are
column-stochastic (what a node sends sums to one), not row-stochastic, so on a directed or
irregular graph plain averaging would drift toward the better-connected nodes; dividing by ``w``
removes that bias. On a graph where every round is doubly stochastic (the one-peer exponential
graph) ``w`` stays 1 and push-sum is D-PSGD.

Runs over TCP (a lost share would lose mass the weight cannot account for), on any topology, with
peer sampling (``epidemic:S``: each node pushes to S peers drawn per round) or the
``one-peer-exponential`` topology."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from meshlearn.definitions.base import (
    Exchange,
    RoundAlgorithm,
    State,
    register_algorithm,
)
from meshlearn.definitions.needs import Needs
from meshlearn.settings import Settings
from meshlearn.topology.sampling import Round, Rounds

if TYPE_CHECKING:
    from torch import Tensor


class PushSumSettings(Settings):
    """Push-sum's settings (flat name: ``pushsum_step``)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"step": "pushsum_step"}

    step: Literal["numerator", "model"] = Field(
        "numerator", description="where the local steps' update goes: numerator (SGP as published: x <- x + update, "
        "so the model moves by update / w) or model (the model moves by the update itself: x <- x + w * update; "
        "steadier where push-sum weights drift far from 1, as with epidemic:1)")


@register_algorithm
class PushSum(RoundAlgorithm):
    """Stochastic Gradient Push: column-stochastic pushes of (model, weight), de-biased model."""

    name = "pushsum"
    settings = PushSumSettings
    keeps_missing = False  # a share that did not arrive is lost to x and w alike: x / w stays unbiased
    needs = Needs(dynamic=True, byzantine=True, why_not=(
        ("lossy", "a lost chunk would change the numerator x but not the weight w, and x / w would drift"),
        ("robust", "a robust rule over numerators of different weights is no push-sum step")))
    summary = "Stochastic Gradient Push, Assran et al. 2019: push-sum over directed and time-varying graphs"

    def __init__(self, rounds: Rounds, nodes: int, seed: int, settings: PushSumSettings | None = None,
                 **run: Sequence[int]):
        super().__init__(rounds, nodes, seed, settings, **run)
        self.step = (settings or PushSumSettings()).step

    def round(self, iteration: int) -> Round:
        """The run's round, each sender's share ``1 / (its peers + 1)`` (column-stochastic)."""
        exchange = self.rounds.round(iteration)
        share = [1.0 / (len(targets) + 1) for targets in exchange.send_to]
        return Round(exchange.send_to, exchange.receive_from,
                     tuple({j: share[j] for j in senders} for senders in exchange.receive_from))

    def own_weights(self, exchange: Round, ranks: list[int]) -> list[float]:
        """What each node keeps of its own push: the same share as it sends each peer."""
        return [1.0 / (len(exchange.send_to[rank]) + 1) for rank in ranks]

    def begin(self, own: Tensor) -> State:
        """``x`` = the first model, ``w`` = 1 (so ``z = x / w`` is the model)."""
        return {"x": own.clone(), "w": own.new_ones(own.shape[0])}

    def payload(self, own: Tensor, state: State, exchange: Exchange) -> Tensor:
        """``x`` plus the local steps' update (``own - x / w``), then ``w``: [B, P + 1]."""
        x, w = state["x"], state["w"]
        update = own - x / w[:, None]
        x.add_(update if self.step == "numerator" else update.mul_(w[:, None]))
        sent = own.new_empty((own.shape[0], own.shape[1] + 1))
        sent[:, :-1] = x
        sent[:, -1] = w
        return sent

    def merge(self, own: Tensor, state: State, mixed: Tensor, exchange: Exchange) -> None:
        """The pushed sums are the new ``x`` and ``w``; the model is ``x / w``."""
        state["x"].copy_(mixed[:, :-1])
        state["w"].copy_(mixed[:, -1])
        own.copy_(state["x"] / state["w"][:, None])
