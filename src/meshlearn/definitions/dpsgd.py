"""D-PSGD (Lian et al. 2017): a ``RoundAlgorithm`` with the defaults (send the model, take the
round's weighted average), and the rules over stacks that both engines' round runners
(``node.algorithms.rounds``, ``batched.algorithms.rounds``) apply to the payloads of any definition
whose declaration takes them: the missing-value rules (lost UDP chunks, a sharing scheme's
shares) and the robust merge (``robust_merge``).

A missing-value rule weighs each neighbour's values where only some arrived (a lossy transport's
chunks, a sharing scheme's shares): ``weights`` [B, K] (each neighbour's Metropolis-Hastings
weight, 0 for padding), ``present`` [B, K, U] (1.0 where a unit, a chunk or a value, arrived),
``own_weight`` [B] and ``sender_degree`` [B, K]; it returns each neighbour's weight per unit
[B, K, U], the node keeping the rest. With everything present every rule is plain
Metropolis-Hastings averaging."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from meshlearn.definitions.base import RoundAlgorithm, register_algorithm
from meshlearn.definitions.needs import ALL_SCHEMES, Needs
from meshlearn.definitions.settings import DpsgdSettings

if TYPE_CHECKING:
    from torch import Tensor

    from meshlearn.aggregation.base import AggregationRule


@register_algorithm
class DpsgdDefinition(RoundAlgorithm):
    """Synchronous decentralized SGD: average with the neighbours after the local steps."""

    name = "dpsgd"
    summary = "synchronous: the Metropolis-Hastings average with the neighbours after the local steps"
    needs = Needs(lossy=True, sharing=ALL_SCHEMES, robust=True, byzantine=True, dynamic=True, torchrun=True,
                  network=True, outer=True)
    settings = DpsgdSettings

    def __init__(self, *args, **run):
        super().__init__(*args, **run)
        self.missing_chunks = (self.options or DpsgdSettings()).missing_chunks


def per_chunk_weights(weights: Tensor, present: Tensor, own_weight: Tensor, sender_degree: Tensor) -> Tensor:
    """The weights renormalised, per unit, over the node and the neighbours that delivered it, so a
    missing value biases toward neither side: with one of three equally weighted neighbours
    missing, the node and the other two get a third each."""
    weight = present * weights[..., None]
    return weight / (own_weight[:, None] + weight.sum(1))[:, None, :]


def fill_local_weights(weights: Tensor, present: Tensor, own_weight: Tensor, sender_degree: Tensor) -> Tensor:
    """The UDP study's rule: ``1 / (1 + max(k, d_j))`` with k the neighbours that delivered anything
    and d_j the sender's degree; a missing value counts as the node's own."""
    heard = present.amax(-1).gt(0).sum(1, keepdim=True)  # [B, 1]
    return present / (1.0 + sender_degree.maximum(heard))[..., None]


def robust_merge(rule: AggregationRule, own: Tensor, received: Tensor, weights: Tensor,
                 present: Tensor | None = None, chunk_elements: int = 0,
                 own_weight: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """A round's merge under a robust aggregation rule, for B nodes: the rule over each node's own
    payload ``own`` [B, P] (its weight ``own_weight`` [B]; None: D-PSGD's, what its neighbours'
    ``weights`` [B, K] leave of one; a node whose own weight is 0 leaves its payload out) and those
    it ``received`` [B, K, P]; per chunk of what arrived where ``present`` [B, K, C] says chunks (or,
    with C = 1, whole payloads) are missing. Returns the aggregates [B, P] and, where every payload
    came whole, [B, K] flags of the received ones deviant from them (``deviant_rows``: for suspicion);
    None where some came in part (the rule saw parts of them)."""
    import torch  # only once a run aggregates

    from meshlearn.aggregation.present import aggregate_present
    from meshlearn.aggregation.suspects import deviant_rows

    models = own.new_empty((own.shape[0], 1 + received.shape[1], own.shape[1]))
    models[:, 0], models[:, 1:] = own, received
    every = weights.new_empty((weights.shape[0], 1 + weights.shape[1]))
    every[:, 0], every[:, 1:] = 1.0 - weights.sum(1) if own_weight is None else own_weight, weights
    whole = present is None or bool(present.all())
    counted = every[:, 0] > 0  # a node whose own weight is 0 pools only what it received
    mask = None
    if present is not None or not bool(counted.all()):
        units = 1 if present is None else present.shape[2]
        mask = torch.ones((own.shape[0], 1 + received.shape[1], units), dtype=torch.bool, device=own.device)
        mask[:, 0] = counted[:, None].to(own.device)
        if present is not None:
            mask[:, 1:] = present
    out = aggregate_present(rule, models, every, mask, chunk_elements, own_always=False)
    return out, deviant_rows(models, out)[:, 1:] if whole else None


MissingValueRule = Callable[["Tensor", "Tensor", "Tensor", "Tensor"], "Tensor"]
MISSING_CHUNK_RULES: dict[str, MissingValueRule] = {"per-chunk": per_chunk_weights, "fill-local": fill_local_weights}
