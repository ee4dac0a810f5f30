"""FedAvg with a parameter server (McMahan et al. 2017): the centralised baseline, so that
federated and decentralized runs compare in one experiment file. One definition, both engines.

Node 0 is the server and trains as a client too. Each iteration has two exchanges (``phases``).
First a seeded share of the nodes (every node draws the same ones) pushes its trained model to
the server, which averages them weighted by their training samples (the seeded partition's shard
sizes, never a count a client sends; a round in which no model came keeps the last average).
Then the server sends the result to every node, and every node trains on from it (one that did not
hear it in time trains on from its own). Nodes that were not drawn skip the round's local steps
(``trains``): their models would be replaced by the server's before being used. So idle nodes cost
nothing, and every node's evaluation is the global model's.

The payload carries a 1 after the model, so the weighted sum the engines compute also gives the
total weight of what arrived: the server divides by it (only what came counts, by samples)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from meshlearn.definitions.base import RoundAlgorithm, State, register_algorithm
from meshlearn.definitions.needs import Needs
from meshlearn.definitions.settings import FedAvgSettings
from meshlearn.errors import ConfigError
from meshlearn.settings import Settings
from meshlearn.topology.sampling import Round, Rounds

if TYPE_CHECKING:
    from torch import Tensor


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


@register_algorithm
class FedAvg(RoundAlgorithm):
    """The drawn nodes push to node 0, which averages by samples and answers everyone (see the module)."""

    name = "fedavg"
    summary = "a parameter server, node 0, averages by samples: the federated baseline; the topology is not used"
    needs = Needs(network=True, outer=True)
    settings = FedAvgSettings
    phases = 2  # the drawn push to the server; the server answers everyone
    talks_to = "server"

    def __init__(self, rounds: Rounds, nodes: int, seed: int, settings: Settings | None = None,
                 shard_sizes: Sequence[int] = (), ranks: Sequence[int] = ()):
        super().__init__(rounds, nodes, seed, settings, shard_sizes=shard_sizes, ranks=ranks)
        if len(self.shard_sizes) != nodes:
            raise ConfigError("FedAvg's server weighs models by every node's shard sizes, from the seeded partition: "
                              f"it was given {len(self.shard_sizes)} shard sizes for {nodes} nodes")
        self.fraction = (settings or FedAvgSettings()).fraction
        from meshlearn.aggregation.weights import by_samples

        self.samples = by_samples(self.shard_sizes)
        self._rounds: dict[tuple[int, int], Round] = {}
        self._server_weight = 0.0

    @property
    def keeps_missing(self) -> bool:
        """Only a node that did not hear the server keeps its own model; a push that did not come
        is simply not averaged."""
        return self.phase == 1

    def trains(self, iteration: int) -> list[int] | None:
        """The nodes drawn for ``iteration`` (None: all of them, at fraction 1)."""
        return None if self.fraction >= 1 else participants(self.seed, iteration, self.nodes, self.fraction)

    def round(self, iteration: int) -> Round:
        """Phase 0: the drawn nodes other than the server push to it, each weighing its samples.
        Phase 1: the server sends to everyone, each taking it whole."""
        key = (iteration, self.phase)
        if key not in self._rounds:
            self._rounds = {key: self._round(iteration)}
        return self._rounds[key]

    def _round(self, iteration: int) -> Round:
        n, nobody = self.nodes, ()
        if self.phase == 0:
            chosen = participants(self.seed, iteration, n, self.fraction)
            self._server_weight = self.samples[SERVER] if SERVER in chosen else 0.0
            pushing = tuple(j for j in chosen if j != SERVER)
            return Round(tuple((SERVER,) if j in pushing else nobody for j in range(n)),
                         (pushing,) + (nobody,) * (n - 1), ({j: self.samples[j] for j in pushing},) + ({},) * (n - 1))
        return Round((tuple(range(1, n)),) + (nobody,) * (n - 1), (nobody,) + ((SERVER,),) * (n - 1),
                     ({},) + ({SERVER: 1.0},) * (n - 1))

    def own_weights(self, exchange: Round, ranks: list[int]) -> list[float]:
        """Of the round last asked for: the server's own model counts by its samples if it was
        drawn; a client keeps nothing of its own once it hears the server."""
        if self.phase == 0:
            return [self._server_weight if rank == SERVER else 1.0 for rank in ranks]
        return [1.0 if rank == SERVER else 0.0 for rank in ranks]

    def begin(self, own: "Tensor") -> State:
        """The last average the server sent (kept by the server's row only)."""
        return {"global": own[self.ranks.index(SERVER)].clone()} if SERVER in self.ranks else {}

    def payload(self, own: "Tensor", state: State, iteration: int) -> "Tensor":
        """The model, then a 1 (what the weighted sum adds up to the weight that came)."""
        sent = own.new_empty((own.shape[0], own.shape[1] + 1))
        sent[:, :-1] = own
        sent[:, -1] = 1.0
        return sent

    def merge(self, own: "Tensor", state: State, mixed: "Tensor", iteration: int) -> None:
        """Each row: the weighted sum over the weight that came; the server with nothing come keeps
        the last average."""
        import torch

        total = mixed[:, -1:]
        row = self.ranks.index(SERVER) if SERVER in self.ranks else None
        if self.phase == 0:  # only the server takes anything: a client's row is its own model over 1, unchanged
            if row is not None:
                if float(total[row]) == 0.0:  # nobody's model this round
                    own[row] = state["global"]
                else:
                    torch.div(mixed[row, :-1], total[row], out=own[row])
        else:
            torch.div(mixed[:, :-1], total.clamp_min(1e-30), out=own)
        if row is not None:
            state["global"].copy_(own[row])
