"""D-PSGD for every node at once: each sends its model to its neighbours, waits for theirs (in
modelled time), and takes the Metropolis-Hastings average of what arrived in time; over UDP, per
chunk, with the chunks the modelled network lost or delayed past the timeout left out."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.batched.algorithms.base import BatchedAlgorithm, BatchedContext, Traffic, register_batched
from meshlearn.batched.loss import ChunkLoss
from meshlearn.batched.mixing import ChunkedMixing, MetropolisMixing
from meshlearn.transport.settings import default_chunk_bytes


@register_batched
class BatchedDPSGD(BatchedAlgorithm):
    """Synchronous D-PSGD (Lian et al. 2017): ``X <- W X``, a neighbour whose model missed the
    deadline left out and its weight given to the node's own model, as in the process engine."""

    name = "dpsgd"

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        super().__init__(ctx, traffic)
        config = ctx.config
        self.mixing = MetropolisMixing(ctx.local)
        self.degree = np.array([ctx.graph.degree(i) for i in range(ctx.graph.n)])
        self.receivers = ctx.links.receiver.cpu().numpy()
        self.chunked: ChunkedMixing | None = None
        if config.transport == "udp":  # per-chunk loss, as the process engine's UDP transport
            state = ctx.stacked.state
            chunk_elements = (config.udp.chunk_bytes or default_chunk_bytes(config.host)) // state.element_size()
            chunks = -(-state.shape[1] // chunk_elements)
            # every process draws every link's mask (the same draws), and uses those of its links
            self.loss = ChunkLoss(config.net, len(ctx.links), chunks, np.random.default_rng([config.seed, 0x1055]))
            self.chunked = ChunkedMixing(ctx.local, ctx.graph, config.dpsgd.missing_chunks, chunk_elements)

    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        ctx, local = self.ctx, self.ctx.local
        columns = {}
        if self.chunked is None:
            arrived, waited = ctx.clocks.gather()
            mine = torch.from_numpy(arrived).to(local.weight.device)[local.ids]
            self.mixing.mix_(ctx.stacked.state, mine, ctx.rows_to_average())
            complete = arrived
        else:
            in_time, waited = ctx.clocks.gather_chunks(self.loss.draw(), wait=ctx.config.udp.mode == "sync")
            mine = torch.from_numpy(in_time).to(local.weight.device)[local.ids]
            self.chunked.mix_(ctx.stacked.state, mine, ctx.rows_to_average())
            arrived = in_time.any(1)
            complete = in_time.all(1) | (ctx.config.udp.mode == "async")  # async: nobody waits, nobody times out
            lost = np.bincount(self.receivers, weights=(~in_time).sum(1), minlength=ctx.graph.n).astype(np.int64)
            self.traffic.add("chunks_lost", lost)
            columns["chunks_missing"] = lost
        received = np.bincount(self.receivers, weights=arrived, minlength=ctx.graph.n).astype(np.int64)
        size = ctx.stacked.row_bytes
        self.traffic.add("messages_sent", self.degree)
        self.traffic.add("bytes_sent", self.degree * size)
        self.traffic.add("messages_received", received)
        self.traffic.add("bytes_received", received * size)
        self.traffic.add("gather_timeouts", np.bincount(self.receivers, weights=~complete, minlength=ctx.graph.n) > 0)
        return {"comm": waited, "received": received, "missing": self.degree - received, **columns}
