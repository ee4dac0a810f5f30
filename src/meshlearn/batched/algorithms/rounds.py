"""The batched engine's runtime for a ``RoundAlgorithm`` (``definitions``): its rules for every
node at once (B = N), each round's links gathered over the modelled network."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from meshlearn.batched.algorithms.base import BatchedAlgorithm, BatchedContext, Traffic
from meshlearn.batched.mixing import Links, mixing_matrix
from meshlearn.definitions.base import RoundAlgorithm
from meshlearn.topology.sampling import Round, rounds_of


class BatchedRounds(BatchedAlgorithm):
    """Each iteration: the round's links and weights from the definition, every node's payload,
    who heard whom in time from the modelled network, and the definition's merge: for a
    ``linear`` one, of one sparse product (weights of late links zero); else of the stacked
    payloads each node received. ``definition`` is set per algorithm (``definitions.base.engine_class``)."""

    definition: ClassVar[type[RoundAlgorithm]]

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        super().__init__(ctx, traffic)
        config = ctx.config
        settings = config.settings_of(self.name) if self.definition.settings is not None else None
        self.rule = self.definition(rounds_of(config.peer_sampling, config.topology, ctx.graph, config.seed),
                                    config.nodes, config.seed, settings, shard_sizes=ctx.samples,
                                    ranks=list(range(config.nodes)))
        self.network = ctx.network
        self.state = self.rule.begin(ctx.stacked.state)
        self._round: tuple[Round, Links, torch.Tensor] | None = None

    @torch.no_grad()
    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        nodes = self.ctx.config.nodes
        record = {"comm": np.zeros(nodes), "received": np.zeros(nodes, dtype=np.int64),
                  "missing": np.zeros(nodes, dtype=np.int64)}
        for phase in range(self.rule.phases):
            self.rule.phase = phase
            for name, values in self._exchange(iteration).items():
                record[name] += values
        return record

    def _exchange(self, iteration: int) -> dict[str, np.ndarray]:
        """One exchange of the iteration, for every node."""
        own = self.ctx.stacked.state
        links, own_weight = self._links(self.rule.round(iteration))
        sent = self.rule.payload(own, self.state, iteration)
        self.network.carry(sent.shape[1] * sent.element_size())
        arrived, waited = self.network.gather(links.sender.cpu().numpy(), links.receiver.cpu().numpy())
        heard = torch.from_numpy(arrived).to(links.weight.device)
        weight = links.weight * heard.to(links.weight.dtype)
        if self.rule.keeps_missing:  # the weight of a sender not heard stays with the node's own
            own_weight = own_weight + links.incoming(links.weight - weight)
        if self.rule.linear:
            mixed = torch.sparse.mm(mixing_matrix(links, weight, own_weight, sent.dtype), sent)
            self.rule.merge(own, self.state, mixed, iteration)
        else:
            received, weights = links.stack(sent[links.sender]), links.stack(weight)
            self.rule.merge_stack(own, self.state, sent, received, weights, own_weight, iteration)
        expected = links.incoming(torch.ones_like(links.weight)).cpu().numpy().astype(np.int64)
        received = links.incoming(heard.to(torch.float64)).cpu().numpy().astype(np.int64)
        return {"comm": waited, "received": received, "missing": expected - received}

    def _links(self, exchange: Round) -> tuple[Links, torch.Tensor]:
        """The round's links and each node's own weight (the last round's again when unchanged)."""
        if self._round is None or self._round[0] is not exchange:
            device = self.ctx.stacked.state.device
            own = torch.tensor(self.rule.own_weights(exchange, list(range(self.ctx.config.nodes))),
                               dtype=torch.float64, device=device)
            self._round = (exchange, Links.of_round(exchange, device), own)
        return self._round[1], self._round[2]
