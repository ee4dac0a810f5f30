"""FedAvg's declaration (McMahan et al. 2017) and the rules both its runtimes (``algorithms.fedavg``,
``batched.algorithms.fedavg``) take from here: which nodes the server takes each round, and how
much each counts."""

from __future__ import annotations

from typing import Sequence

from meshlearn.definitions.base import Definition, register_algorithm
from meshlearn.definitions.needs import Needs
from meshlearn.definitions.settings import FedAvgSettings


@register_algorithm
class FedAvgDefinition(Definition):
    """A parameter server (node 0) averages the drawn nodes' models by training samples."""

    name = "fedavg"
    summary = "a parameter server, node 0, averages by samples: the federated baseline; the topology is not used"
    needs = Needs(network=True)
    settings = FedAvgSettings


SERVER = 0
SALT = 0xFEDA


def participants(seed: int, iteration: int, nodes: int, fraction: float) -> list[int]:
    """The nodes whose models the server takes at ``iteration`` (sorted; all of them at 1.0)."""
    import numpy as np

    from meshlearn.sharing.base import share_count

    count = share_count(fraction, nodes)
    if count == nodes:
        return list(range(nodes))
    return sorted(int(i) for i in np.random.default_rng([seed, SALT, iteration]).choice(nodes, count, replace=False))


def sample_weights(contributors: list[int], shard_sizes: Sequence[int]) -> dict[int, float]:
    """Each contributor's weight: its share of the contributors' training samples. The sizes come
    from the run's seeded partition, which the server computes itself: a count a client claimed
    over the network could make it outweigh everyone (or, huge, zero every weight)."""
    from meshlearn.aggregation.weights import by_samples

    counts = by_samples([shard_sizes[rank] for rank in contributors])
    total = sum(counts)
    return {rank: count / total for rank, count in zip(contributors, counts)}
