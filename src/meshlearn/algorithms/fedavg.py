"""FedAvg with a parameter server (McMahan et al. 2017): the centralised baseline, so that
federated and decentralized runs compare in one experiment file.

Node 0 is the server and trains as a client too. Each round a seeded share of the nodes (every
node draws the same ones) sends its trained model to the server, which averages them weighted by
their training samples and sends the result to every node; every node trains on from it. Nodes
that were not drawn train that round too, but their models are replaced by the server's before
they are used, so the result is FedAvg's (only their compute is spent for nothing), and every
node's evaluation is the global model's.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from meshlearn.aggregation.suspects import refusal
from meshlearn.algorithms.averaging import weighted_average_
from meshlearn.algorithms.base import Algorithm, AlgorithmContext, register_algorithm
from meshlearn.algorithms.settings import FedAvgSettings
from meshlearn.transport import Transport
from meshlearn.wire import Kind, Message, meta_number

log = logging.getLogger(__name__)

SERVER = 0
SALT = 0xFEDA


def participants(seed: int, iteration: int, nodes: int, fraction: float) -> list[int]:
    """The nodes whose models the server takes at ``iteration`` (sorted; all of them at 1.0)."""
    count = max(1, min(nodes, math.ceil(fraction * nodes)))
    if count == nodes:
        return list(range(nodes))
    return sorted(int(i) for i in np.random.default_rng([seed, SALT, iteration]).choice(nodes, count, replace=False))


def sample_weights(samples: dict[int, float]) -> dict[int, float]:
    """Each contributor's weight: its share of the contributors' training samples."""
    total = sum(samples.values())
    return {rank: count / total for rank, count in samples.items()}


@register_algorithm
class FedAvg(Algorithm):
    """Synchronous FedAvg: the drawn nodes push to node 0, which averages and answers everyone."""

    name = "fedavg"
    endpoint = Transport
    talks_to = "server"

    def __init__(self, ctx: AlgorithmContext):
        super().__init__(ctx)
        self.fraction = (ctx.settings or FedAvgSettings()).fraction
        self.nodes = ctx.graph.n

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        ctx = self.ctx
        chosen = participants(ctx.seed, iteration, self.nodes, self.fraction)
        t0 = time.perf_counter()
        if ctx.rank == SERVER:
            heard = self._serve(iteration, chosen)
        else:
            heard = self._take_part(iteration, chosen)
        t1 = time.perf_counter()
        return {"comm": t1 - t0, "received": heard, "missing": (len(chosen) - (SERVER in chosen) if ctx.rank == SERVER
                                                                 else 1) - heard}

    def _serve(self, iteration: int, chosen: list[int]) -> int:
        """Average the drawn nodes' models (its own among them if drawn) and send the result to all."""
        ctx = self.ctx
        received = ctx.transport.gather(iteration, [j for j in chosen if j != SERVER])
        samples = {SERVER: float(ctx.samples)} if SERVER in chosen else {}
        for sender in sorted(received):
            msg = received[sender]
            problem = ctx.flat.check_compatible(msg.tensors) or next(filter(None, map(refusal, msg.tensors.values())),
                                                                      None)
            count = meta_number(msg.meta, "samples", -1.0)
            if problem is None and not count:
                problem = f"its sample count {msg.meta.get('samples')!r} is not a positive number"
            if problem is None:
                samples[sender] = count
                self.watch.heard(sender)
            else:
                self.watch.refused(sender, problem)
                log.warning("node %d: refused the model of %d: %s", ctx.rank, sender, problem)
        if samples:
            weights = sample_weights(samples)
            others = [(weights[j], received[j]) for j in sorted(samples) if j != SERVER]
            for name, target in ctx.flat.tensors().items():
                weighted_average_(target, weights.get(SERVER, 0.0), [(w, msg.tensors[name]) for w, msg in others])
        snapshot = ctx.flat.snapshot()
        everyone = [j for j in range(self.nodes) if j != SERVER]
        ctx.flat.release(snapshot, ctx.transport.broadcast(everyone, Message(Kind.MODEL, ctx.rank, iteration,
                                                                              len(everyone), snapshot)))
        ctx.transport.recycle(received.values())
        return len(samples) - (SERVER in samples)

    def _take_part(self, iteration: int, chosen: list[int]) -> int:
        """Send the trained model if drawn, then take the server's average (1 if it came)."""
        ctx = self.ctx
        if ctx.rank in chosen:
            snapshot = ctx.flat.snapshot()
            ctx.flat.release(snapshot, ctx.transport.broadcast([SERVER], Message(
                Kind.MODEL, ctx.rank, iteration, 1, snapshot, meta={"samples": ctx.samples})))
        received = ctx.transport.gather(iteration, [SERVER])
        if SERVER not in received:
            return 0  # late: it trains on from its own model, and takes the next round's average
        msg = received[SERVER]
        problem = ctx.flat.check_compatible(msg.tensors) or next(filter(None, map(refusal, msg.tensors.values())), None)
        if problem is not None:
            self.watch.refused(SERVER, problem)
            log.warning("node %d: refused the server's model: %s", ctx.rank, problem)
            return 0
        self.watch.heard(SERVER)
        ctx.flat.load(msg.tensors)
        ctx.transport.recycle(received.values())
        return 1
