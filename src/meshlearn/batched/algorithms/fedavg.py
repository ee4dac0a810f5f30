"""FedAvg for every node at once: the drawn nodes' rows go to node 0 (in modelled time), whose
sample-weighted average every row then takes, as the process engine's ``algorithms.fedavg``."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.algorithms.averaging import weighted_average_
from meshlearn.batched.algorithms.base import (
    BatchedAlgorithm,
    BatchedContext,
    Traffic,
    register_batched,
)
from meshlearn.definitions.fedavg import SERVER, participants, sample_weights


@register_batched
class BatchedFedAvg(BatchedAlgorithm):
    """Synchronous FedAvg with node 0 as the parameter server (see ``algorithms.fedavg``)."""

    name = "fedavg"

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        super().__init__(ctx, traffic)
        self.fraction = ctx.config.fedavg.fraction
        self.nodes = ctx.config.nodes
        self.clients = np.arange(1, self.nodes)
        self.global_model = ctx.stacked.state[SERVER].clone()  # the last average the server sent

    @torch.no_grad()
    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        ctx, network, n = self.ctx, self.ctx.network, self.nodes
        state = ctx.stacked.state
        chosen = participants(ctx.config.seed, iteration, n, self.fraction)
        pushing = np.array([j for j in chosen if j != SERVER], dtype=np.int64)
        pushed, wait_up = network.gather(pushing, np.zeros(len(pushing), dtype=np.int64))
        contributors = ([SERVER] if SERVER in chosen else []) + [int(j) for j in pushing[pushed]]
        if contributors:
            weights = sample_weights(contributors, ctx.samples)
            weighted_average_(state[SERVER], weights.get(SERVER, 0.0),
                              [(weights[j], state[j]) for j in contributors if j != SERVER])
        else:  # nobody's model this round: the global model stays what it was
            state[SERVER] = self.global_model
        self.global_model.copy_(state[SERVER])
        answered, wait_down = network.gather(np.zeros(n - 1, dtype=np.int64), self.clients)
        taking = torch.from_numpy(self.clients[answered]).to(state.device)
        state[taking] = state[SERVER].clone()
        received = np.zeros(n, dtype=np.int64)
        received[SERVER] = int(pushed.sum())
        received[self.clients[answered]] = 1
        expected = np.ones(n, dtype=np.int64)
        expected[SERVER] = len(pushing)
        return {"comm": wait_up + wait_down, "received": received, "missing": expected - received}
