"""D-PSGD: after the local steps, send the model to every neighbour and take the
Metropolis-Hastings weighted average of what arrived."""

from __future__ import annotations

import logging
import time

from meshlearn.algorithms.averaging import (
    MISSING_CHUNK_RULES,
    chunked_average_,
    weighted_average_,
)
from meshlearn.algorithms.base import Algorithm, AlgorithmContext, register_algorithm
from meshlearn.algorithms.settings import DpsgdSettings
from meshlearn.topology import mh_row
from meshlearn.transport import Transport
from meshlearn.wire import Kind, Message

log = logging.getLogger(__name__)


@register_algorithm
class DPSGD(Algorithm):
    """Synchronous decentralized parallel SGD (Lian et al. 2017), as in DecentralizePy.

    A neighbour whose model misses the deadline is left out of this iteration's average and
    its weight goes to the node's own model, so the weights still sum to one. Over a lossy
    transport, lost chunks (and wholly lost models) are averaged per chunk by ``missing_chunks``.
    """

    name = "dpsgd"
    endpoint = Transport

    def __init__(self, ctx: AlgorithmContext):
        super().__init__(ctx)
        settings = ctx.settings or DpsgdSettings()
        row = mh_row(ctx.graph, ctx.rank)
        self.neighbours = ctx.graph.neighbours(ctx.rank)
        self.weights = {j: w for j, w in row.items() if j != ctx.rank}
        self.own_weight = 1.0 - sum(self.weights.values())
        self.lossy = ctx.transport.lossy
        self.missing_chunk_rule = MISSING_CHUNK_RULES[settings.missing_chunks]  # chosen once

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        ctx = self.ctx
        t0 = time.perf_counter()
        snapshot = ctx.flat.snapshot()
        msg = Message(Kind.MODEL, ctx.rank, iteration, len(self.neighbours), snapshot)
        t1 = time.perf_counter()
        ctx.flat.release(snapshot, ctx.transport.broadcast(self.neighbours, msg))
        received = ctx.transport.gather(iteration, self.neighbours)
        t2 = time.perf_counter()
        usable = []
        # Sum in rank order, not arrival order, so that a run is bit-for-bit reproducible.
        for sender in sorted(received):
            problem = ctx.flat.check_compatible(received[sender].tensors)
            if problem is None:
                usable.append(sender)
            else:
                log.warning("node %d: ignored the model of %d: %s", ctx.rank, sender, problem)
        partial = [received[j] for j in usable if received[j].chunks is not None and received[j].chunks.missing]
        if partial or (self.lossy and usable and len(usable) < len(self.neighbours)):
            chunked_average_(ctx.flat.state, self.own_weight, [(self.weights[j], received[j]) for j in usable],
                             self.missing_chunk_rule)
        else:
            own = 1.0 - sum(self.weights[j] for j in usable)
            for name, target in ctx.flat.tensors().items():
                weighted_average_(target, own, [(self.weights[j], received[j].tensors[name]) for j in usable])
        ctx.transport.recycle(received.values())
        t3 = time.perf_counter()
        return {
            "encode": t1 - t0,
            "comm": t2 - t1,
            "average": t3 - t2,
            "received": len(usable),
            "missing": len(self.neighbours) - len(usable),
            "partial": len(partial),
            "chunks_missing": sum(m.chunks.missing for m in partial),
        }
