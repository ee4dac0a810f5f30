"""D-PSGD for every node at once: each sends its model to its neighbours, waits for theirs (in
modelled time), and takes the Metropolis-Hastings average of what arrived in time."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.batched.algorithms.base import BatchedAlgorithm, BatchedContext, Traffic, register_batched
from meshlearn.batched.mixing import MetropolisMixing


@register_batched
class BatchedDPSGD(BatchedAlgorithm):
    """Synchronous D-PSGD (Lian et al. 2017): ``X <- W X``, a neighbour whose model missed the
    deadline left out and its weight given to the node's own model, as in the process engine."""

    name = "dpsgd"

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        super().__init__(ctx, traffic)
        self.mixing = MetropolisMixing(ctx.links)
        self.degree = np.array([ctx.graph.degree(i) for i in range(ctx.graph.n)])

    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        ctx, links = self.ctx, self.ctx.links
        arrived, waited = ctx.clocks.gather()
        self.mixing.mix_(ctx.stacked.state, torch.from_numpy(arrived).to(links.weight.device))
        received = np.bincount(links.receiver.cpu().numpy(), weights=arrived, minlength=ctx.graph.n).astype(np.int64)
        size = ctx.stacked.row_bytes
        self.traffic.add("messages_sent", self.degree)
        self.traffic.add("bytes_sent", self.degree * size)
        self.traffic.add("messages_received", received)
        self.traffic.add("bytes_received", received * size)
        self.traffic.add("gather_timeouts", received < self.degree)
        return {"comm": waited, "received": received, "missing": self.degree - received}
