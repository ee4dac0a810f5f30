"""What a decentralized run minimises (``objective``): the mean of the nodes' losses, each node
alike (``nodes``, D-PSGD's objective and the default), or the loss over every training sample, as
one model trained on the pooled data minimises it (``samples``).

Over a label-skewed split the two differ: with Dirichlet 0.1 over 16 nodes of Fashion-MNIST the
shards hold 188 to 10,261 images, so equal batches from every node over-represent the small
shards' classes (one class 17% of what the nodes see together, another 5.5%), and even a run that
averages exactly trains another model than one model on all the data. With ``samples`` each
node's gradients are scaled by ``N n_i / Σ n`` (``n_i`` its training samples): the nodes' average
gradient is then an unbiased estimate of the pooled loss's gradient, as FedAvg's server weighs
clients by their samples.

What it assumes: a synchronous algorithm whose nodes average with their neighbours (``dpsgd``,
``tracking``, ``gtadam``, ``dadam``, ``qgdsgdm``, ``pushsum``); an optimizer whose step moves with
the gradient's scale, SGD (with momentum), or ``gtadam``, whose Adam steps along the tracked
average of the scaled gradients (a node's own Adam normalises a scale away). No torch at import."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from meshlearn.aggregation.weights import by_samples
from meshlearn.definitions.base import DEFINITIONS, RoundAlgorithm, definition

Objective = Literal["nodes", "samples"]
OBJECTIVE_HELP = ("what the nodes minimise together: nodes (the mean of their losses, each node alike) | samples "
                  "(the loss over all their training samples, one model's on the pooled data: each node's gradients "
                  "scaled by its share of the samples; dpsgd, tracking, gtadam, dadam, qgdsgdm, pushsum, with "
                  "optimizer sgd, or gtadam with any)")


def takes_weights(found: type) -> bool:
    """Whether an algorithm's nodes average with their neighbours in lockstep (a ``RoundAlgorithm``
    talking to its neighbours), so scaled gradients weigh its nodes' losses."""
    return isinstance(found, type) and issubclass(found, RoundAlgorithm) and found.talks_to == "neighbours"


def objective_refusal(algorithm: str, objective: str, optimizer: tuple[str, dict]) -> str | None:
    """Why a run (its ``algorithm`` name and parsed ``optimizer``) cannot minimise ``objective``,
    in one line naming what to change; or None."""
    if objective == "nodes":
        return None
    if not takes_weights(definition(algorithm)):
        names = ", ".join(name for name in DEFINITIONS.names() if takes_weights(definition(name)))
        return (f"objective samples scales the gradients of nodes that average with their neighbours ({names}), not "
                f"algorithm {algorithm}'s: use objective nodes" +
                (" (fedavg's server already weighs clients by their samples)" if algorithm == "fedavg" else ""))
    if optimizer != ("SGD", {}) and algorithm != "gtadam":
        return ("objective samples scales each node's gradients, which an adaptive optimizer's own step normalises "
                "away: use optimizer sgd, or algorithm gtadam (its Adam steps along the tracked average)")
    return None


def sample_weights(shard_sizes: Sequence[int], ranks: Sequence[int]) -> list[float]:
    """Each of the nodes ``ranks``' weight ``N n_i / Σ n`` over the run's ``shard_sizes``, each
    ``n_i`` as FedAvg's server counts it (``by_samples``: an empty shard as one sample)."""
    counts = by_samples(shard_sizes)
    total = sum(counts)
    return [len(counts) * counts[rank] / total for rank in ranks]


def weighted_optimizer(optimizer: Any, rules: RoundAlgorithm, objective: str) -> Any:
    """The engines' local optimizer for ``rules``' rows under ``objective``: ``optimizer`` itself,
    or for ``samples`` one that scales each row's gradients by ``sample_weights`` first."""
    if objective == "nodes":
        return optimizer
    from meshlearn.optim import ScaledGradients

    params = optimizer.params
    return ScaledGradients(optimizer, params.new_tensor(sample_weights(rules.shard_sizes, rules.ranks)))
