"""D-PSGD's declaration (Lian et al. 2017) and its missing-value rules over stacks, which both
engines' runtimes (``algorithms.dpsgd``, ``batched.algorithms.dpsgd``) call: they add what a
``RoundAlgorithm`` does not yet express (lost UDP chunks, robust rules, attacks, sharing schemes).

A missing-value rule weighs each neighbour's values where only some arrived (a lossy transport's
chunks, a sharing scheme's shares): ``weights`` [B, K] (each neighbour's Metropolis-Hastings
weight, 0 for padding), ``present`` [B, K, U] (1.0 where a unit, a chunk or a value, arrived),
``own_weight`` [B] and ``sender_degree`` [B, K]; it returns each neighbour's weight per unit
[B, K, U], the node keeping the rest. With everything present every rule is plain
Metropolis-Hastings averaging."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from meshlearn.definitions.base import Definition, register_algorithm
from meshlearn.definitions.needs import ALL_SCHEMES, Needs
from meshlearn.definitions.settings import DpsgdSettings

if TYPE_CHECKING:
    from torch import Tensor


@register_algorithm
class DpsgdDefinition(Definition):
    """Synchronous decentralized SGD: average with the neighbours after the local steps."""

    name = "dpsgd"
    summary = "synchronous: the Metropolis-Hastings average with the neighbours after the local steps"
    needs = Needs(lossy=True, sharing=ALL_SCHEMES, robust=True, byzantine=True, dynamic=True, torchrun=True,
                  network=True)
    settings = DpsgdSettings


def per_chunk_weights(weights: "Tensor", present: "Tensor", own_weight: "Tensor", sender_degree: "Tensor") -> "Tensor":
    """The weights renormalised, per unit, over the node and the neighbours that delivered it, so a
    missing value biases toward neither side: with one of three equally weighted neighbours
    missing, the node and the other two get a third each."""
    weight = present * weights[..., None]
    return weight / (own_weight[:, None] + weight.sum(1))[:, None, :]


def fill_local_weights(weights: "Tensor", present: "Tensor", own_weight: "Tensor", sender_degree: "Tensor") -> "Tensor":
    """The UDP study's rule: ``1 / (1 + max(k, d_j))`` with k the neighbours that delivered anything
    and d_j the sender's degree; a missing value counts as the node's own."""
    heard = present.amax(-1).gt(0).sum(1, keepdim=True)  # [B, 1]
    return present / (1.0 + sender_degree.maximum(heard))[..., None]


MissingValueRule = Callable[["Tensor", "Tensor", "Tensor", "Tensor"], "Tensor"]
MISSING_CHUNK_RULES: dict[str, MissingValueRule] = {"per-chunk": per_chunk_weights, "fill-local": fill_local_weights}
