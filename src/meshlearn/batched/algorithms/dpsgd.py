"""D-PSGD for every node at once: each sends its model to its neighbours, waits for theirs (in
modelled time), and takes the Metropolis-Hastings average of what arrived in time. The plain
average is the round runner's (``BatchedRounds``: one sparse product, static or dynamic rounds,
under torchrun too); this file adds the variants over a static graph: per chunk over a lossy
network, a robust rule, a sharing scheme, and bad nodes sending what their attack forges."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.aggregation.base import get_rule
from meshlearn.batched.algorithms.base import BatchedContext, Traffic
from meshlearn.batched.algorithms.rounds import BatchedRounds, heard_counts
from meshlearn.batched.byzantine import BadNodes
from meshlearn.batched.mixing import ChunkedMixing, Links
from meshlearn.batched.robust import RobustMixing
from meshlearn.batched.sharing import SharedMixing
from meshlearn.definitions.base import Exchange
from meshlearn.definitions.dpsgd import DpsgdDefinition
from meshlearn.topology.sampling import Round


class BatchedDPSGD(BatchedRounds):
    """Synchronous D-PSGD (Lian et al. 2017): ``X <- W X``, a neighbour whose model missed the
    deadline left out and its weight given to the node's own model. Over a lossy network, per
    chunk (``ChunkedMixing``); with a robust ``aggregation`` rule, each node's rule over its own row
    and those that arrived (``RobustMixing``); with a ``sharing`` scheme, what each node's scheme
    makes of the rows (``SharedMixing``). Bad nodes (``byzantine``) send what their attack forges."""

    state_fields = (*BatchedRounds.state_fields, "variant")

    def __init__(self, ctx: BatchedContext, traffic: Traffic):
        super().__init__(ctx, traffic, DpsgdDefinition)
        config, state = ctx.config, ctx.stacked.state
        self.bad = BadNodes(config, ctx.shard.start, state, ctx.links, ctx.local)
        links = self.bad.links  # the local links, those out of a bad node reading its forged row
        rule = get_rule(config.aggregation)
        chunk_elements = ctx.network.chunk_bytes // state.element_size() if ctx.network.lossy else 0
        self.chunks = -(-state.shape[1] // chunk_elements) if chunk_elements else 0
        self.variant: ChunkedMixing | RobustMixing | SharedMixing | None = None  # None: the plain average
        if config.sharing != "full":
            self.variant = SharedMixing(config.sharing, state, links, [ctx.graph.degree(i) for i in range(ctx.graph.n)],
                                        config.dpsgd.missing_chunks, config.seed, ctx.network.chunk_bytes)
            self.chunks = self.variant.chunks  # of the scheme's message
        elif rule.robust:
            self.variant = RobustMixing(links, rule, chunk_elements)
        elif chunk_elements:
            self.variant = ChunkedMixing(links, ctx.graph, config.dpsgd.missing_chunks, chunk_elements)

    def _exchange(self, exchange: Exchange, sent: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        if self.variant is None:
            return super()._exchange(exchange, sent)
        iteration = exchange.iteration
        ctx, state, network, variant = self.ctx, self.ctx.stacked.state, self.ctx.network, self.variant
        senders, receivers = ctx.links.sender.cpu().numpy(), ctx.links.receiver.cpu().numpy()
        columns = {}
        if self.chunks:
            present, waited, columns["chunks_missing"] = network.gather_chunks(senders, receivers, self.chunks,
                                                                               self.bad.skipped)
        else:
            present, waited = network.gather(senders, receivers, self.bad.skipped)
        arrived = present.any(1) if self.chunks else present
        mine = torch.from_numpy(present).to(state.device)[ctx.local.ids]
        if isinstance(variant, SharedMixing):
            variant.mix_(state, mine, iteration)
        else:
            variant.mix_(state, source=self.sources(state, iteration), arrived=mine)
        return {"comm": waited, **heard_counts(ctx.links, arrived), **columns}

    def links_of(self, exchange: Round) -> tuple[Links, Links]:
        everyone, links = super().links_of(exchange)
        return (everyone, self.bad.links) if links is self.ctx.local else (everyone, links)

    def silent(self) -> np.ndarray | None:
        return self.bad.skipped if self.bad else None

    def sources(self, sent: torch.Tensor, iteration: int) -> torch.Tensor:
        """The rows the links read: this block's, those of other blocks, then this block's bad
        nodes' forged rows."""
        ctx, bad = self.ctx, self.bad
        seen = ctx.rows_to_average(sent) if bad.rushing else None  # every block exchanges as often
        if not bad:
            return ctx.rows_to_average(sent)
        forged = bad.forge(sent, iteration, seen)
        return torch.cat([ctx.rows_to_average(bad.sent(sent, forged) if ctx.plan is not None else sent), forged])

    def peers_report(self) -> dict[int, dict]:
        return self.variant.reports() if isinstance(self.variant, RobustMixing) else {}
