"""FedAvg with a parameter server (McMahan et al. 2017): the centralised baseline, so that
federated and decentralized runs compare in one experiment file.

Node 0 is the server and trains as a client too. Each round a seeded share of the nodes (every
node draws the same ones) sends its trained model to the server, which averages them weighted by
their training samples (the seeded partition's shard sizes; a round in which no model came keeps
the last average) and sends the result to every node; every node trains on from it. Nodes
that were not drawn train that round too, but their models are replaced by the server's before
they are used, so the result is FedAvg's (only their compute is spent for nothing), and every
node's evaluation is the global model's.
"""

from __future__ import annotations

import logging
import time

import torch

from meshlearn.aggregation.suspects import refusal
from meshlearn.algorithms.averaging import weighted_average_
from meshlearn.algorithms.base import Algorithm, AlgorithmContext, register_runtime
from meshlearn.definitions.fedavg import SERVER, participants, sample_weights
from meshlearn.definitions.settings import FedAvgSettings
from meshlearn.errors import ConfigError
from meshlearn.transport import Transport
from meshlearn.wire import Kind, Message

log = logging.getLogger(__name__)

@register_runtime
class FedAvg(Algorithm):
    """Synchronous FedAvg: the drawn nodes push to node 0, which averages and answers everyone."""

    name = "fedavg"
    endpoint = Transport
    talks_to = "server"

    def __init__(self, ctx: AlgorithmContext):
        super().__init__(ctx)
        self.fraction = (ctx.settings or FedAvgSettings()).fraction
        self.nodes = ctx.graph.n
        if len(ctx.shard_sizes) != self.nodes:
            raise ConfigError("fedavg's server weighs the nodes by their shard sizes: build its nodes with "
                              "every node's shard size (build_node does)")
        self.global_model: torch.Tensor | None = None  # the server's: the last average it sent

    def start(self) -> None:
        super().start()
        if self.ctx.rank == SERVER:
            self.global_model = self.ctx.flat.state.detach().clone()

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
        contributors = [SERVER] if SERVER in chosen else []
        for sender in sorted(received):
            problem = self._problem(received[sender])
            if problem is None:
                contributors.append(sender)
                self.watch.heard(sender)
            else:
                self.watch.refused(sender, problem)
                log.warning("node %d: refused the model of %d: %s", ctx.rank, sender, problem)
        if contributors:
            weights = sample_weights(contributors, ctx.shard_sizes)
            others = [(weights[j], received[j]) for j in contributors if j != SERVER]
            for name, target in ctx.flat.tensors().items():
                weighted_average_(target, weights.get(SERVER, 0.0), [(w, msg.tensors[name]) for w, msg in others])
        else:  # nobody's model this round: the global model stays what it was
            ctx.flat.state.copy_(self.global_model)
        self.global_model.copy_(ctx.flat.state)
        snapshot = ctx.flat.snapshot()
        everyone = [j for j in range(self.nodes) if j != SERVER]
        ctx.flat.release(snapshot, ctx.transport.broadcast(everyone, Message(Kind.MODEL, ctx.rank, iteration,
                                                                              len(everyone), snapshot)))
        ctx.transport.recycle(received.values())
        return len(contributors) - (SERVER in contributors)

    def _problem(self, msg: Message) -> str | None:
        """Why a model that arrived cannot be averaged (None if it can)."""
        return self.ctx.flat.check_compatible(msg.tensors) or next(filter(None, map(refusal, msg.tensors.values())),
                                                                    None)

    def _take_part(self, iteration: int, chosen: list[int]) -> int:
        """Send the trained model if drawn, then take the server's average (1 if it came)."""
        ctx = self.ctx
        if ctx.rank in chosen:
            snapshot = ctx.flat.snapshot()
            ctx.flat.release(snapshot, ctx.transport.broadcast([SERVER], Message(
                Kind.MODEL, ctx.rank, iteration, 1, snapshot)))
        received = ctx.transport.gather(iteration, [SERVER])
        if SERVER not in received:
            return 0  # late: it trains on from its own model, and takes the next round's average
        msg = received[SERVER]
        problem = self._problem(msg)
        if problem is not None:
            self.watch.refused(SERVER, problem)
            log.warning("node %d: refused the server's model: %s", ctx.rank, problem)
            return 0
        self.watch.heard(SERVER)
        ctx.flat.load(msg.tensors)
        ctx.transport.recycle(received.values())
        return 1
