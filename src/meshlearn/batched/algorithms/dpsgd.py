"""D-PSGD for every node at once: each sends its model to its neighbours, waits for theirs (in
modelled time), and takes the Metropolis-Hastings average of what arrived in time; over UDP, per
chunk, with the chunks the modelled network lost or delayed past the timeout left out."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.aggregation.base import get_rule
from meshlearn.batched.algorithms.base import (
    BatchedAlgorithm,
    BatchedContext,
    Traffic,
    register_batched,
)
from meshlearn.batched.byzantine import BadNodes
from meshlearn.batched.mixing import ChunkedMixing, Links, MetropolisMixing
from meshlearn.batched.robust import RobustMixing
from meshlearn.batched.sharing import SharedMixing
from meshlearn.errors import ConfigError
from meshlearn.topology.sampling import dynamic_rounds


@register_batched
class BatchedDPSGD(BatchedAlgorithm):
    """Synchronous D-PSGD (Lian et al. 2017): ``X <- W X``, a neighbour whose model missed the
    deadline left out and its weight given to the node's own model, as in the process engine. With
    a robust ``aggregation`` rule, each node's rule over its own row and those that arrived (per
    chunk over a lossy link); bad nodes (``byzantine``) send what their attack forges."""

    name = "dpsgd"

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        super().__init__(ctx, traffic)
        config = ctx.config
        self.bad = BadNodes(config, ctx.shard.start, ctx.stacked.state, ctx.links, ctx.local)
        links = self.bad.links  # the local links, those out of a bad node reading its forged row
        self.rule = get_rule(config.aggregation)
        self.mixing = MetropolisMixing(links)
        self.degree = np.array([ctx.graph.degree(i) for i in range(ctx.graph.n)])
        self.senders, self.receivers = ctx.links.sender.cpu().numpy(), ctx.links.receiver.cpu().numpy()
        self.chunked: ChunkedMixing | None = None
        chunk_elements = 0
        if ctx.network.lossy:  # per-chunk loss, as the process engine's UDP transport
            state = ctx.stacked.state
            chunk_elements = ctx.network.chunk_bytes // state.element_size()
            self.chunks = -(-state.shape[1] // chunk_elements)
            self.chunked = ChunkedMixing(links, ctx.graph, config.dpsgd.missing_chunks, chunk_elements)
        self.robust = RobustMixing(links, self.rule, chunk_elements) if self.rule.robust else None
        self.sampler = dynamic_rounds(config.peer_sampling, config.topology, config.nodes, config.seed)
        if self.sampler is not None and ctx.plan is not None:
            raise ConfigError(f"peer_sampling {config.peer_sampling} and topology {config.topology} run in one process "
                              "of the batched engine, not under torchrun: start it without torchrun")
        self.shared: SharedMixing | None = None
        if config.sharing != "full":
            if ctx.plan is not None:
                raise ConfigError(f"sharing {config.sharing} runs in one process of the batched engine, not under "
                                  "torchrun: start it without torchrun, or use sharing full")
            self.shared = SharedMixing(config.sharing, ctx.stacked.state, links, list(self.degree),
                                       config.dpsgd.missing_chunks, config.seed)

    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        if self.sampler is not None:
            self._join_round(iteration)
        ctx, local, network = self.ctx, self.ctx.local, self.ctx.network
        columns = {}
        state, source = ctx.stacked.state, self._sources(iteration)
        if self.chunked is None:
            arrived, waited = network.gather(self.senders, self.receivers, self.bad.skipped)
            mine = torch.from_numpy(arrived).to(local.weight.device)[local.ids]
            if self.shared is not None:
                self.shared.mix_(state, mine, iteration)
            elif self.robust is not None:
                self.robust.mix_(state, source, mine)
            else:
                self.mixing.mix_(state, mine, source)
        else:
            in_time, waited, columns["chunks_missing"] = network.gather_chunks(
                self.senders, self.receivers, self.chunks, self.bad.skipped)
            mine = torch.from_numpy(in_time).to(local.weight.device)[local.ids]
            if self.robust is not None:
                self.robust.mix_(state, source, mine)
            else:
                self.chunked.mix_(state, mine, source)
            arrived = in_time.any(1)
        received = np.bincount(self.receivers, weights=arrived, minlength=ctx.graph.n).astype(np.int64)
        return {"comm": waited, "received": received, "missing": self.degree - received, **columns}

    def _join_round(self, iteration: int) -> None:
        """This iteration's links, weights and senders, from the peer sampler."""
        exchange = self.sampler.round(iteration)
        ctx = self.ctx
        links = Links.of_round(exchange, ctx.links.receiver.device)
        ctx.local = ctx.links = links
        self.mixing = MetropolisMixing(links)
        self.bad = BadNodes(ctx.config, ctx.shard.start, ctx.stacked.state, links, links)
        self.degree = np.array([len(targets) for targets in exchange.send_to])
        self.senders, self.receivers = links.sender.cpu().numpy(), links.receiver.cpu().numpy()

    def _sources(self, iteration: int) -> torch.Tensor:
        """The rows the links read: this block's, those of other blocks, then this block's bad
        nodes' forged rows."""
        ctx, bad = self.ctx, self.bad
        seen = ctx.rows_to_average() if bad.rushing else None  # every block exchanges as often
        if not bad:
            return ctx.rows_to_average()
        state = ctx.stacked.state
        forged = bad.forge(state, iteration, seen)
        return torch.cat([ctx.rows_to_average(bad.sent(state, forged) if ctx.plan is not None else None), forged])

    def peers_report(self) -> dict[int, dict]:
        return {} if self.robust is None else self.robust.reports()
