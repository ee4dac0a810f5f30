"""The batched engine's runtime for a ``RoundAlgorithm`` (``definitions``): its rules for every
node at once (B = N), each round's links gathered over the modelled network."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.batched.algorithms.base import BatchedAlgorithm, BatchedContext, Traffic
from meshlearn.batched.mixing import Links, heard_weights, weighted_sums
from meshlearn.definitions.base import Exchange, RoundAlgorithm
from meshlearn.topology.sampling import Round, StaticRounds, rounds_of


class BatchedRounds(BatchedAlgorithm):
    """Runs the ``RoundAlgorithm`` it is given (``definition``, its class) for every node. Each
    iteration, each of its exchanges: the definition's ``Exchange`` (the round's links and
    weights), every node's payload, who heard whom in time from the modelled network, and the
    definition's merge: for a ``linear`` one, of one sparse product (weights of late links zero);
    else of the stacked payloads each node received.

    Under torchrun (a static graph) this process holds a block of the nodes: the links into it are
    ``ctx.local`` and the rows its links read (``sources``) are the block's payloads, then those
    the other blocks send. Every process models the whole run's network (the same draws)."""

    state_fields = ("state", "_done_at")

    def __init__(self, ctx: BatchedContext, traffic: Traffic, definition: type[RoundAlgorithm]):
        self.name = definition.name
        super().__init__(ctx, traffic)
        config = ctx.config
        settings = config.settings_of(self.name) if definition.settings is not None else None
        self.rounds = rounds_of(config.peer_sampling, config.topology, ctx.graph, config.seed)
        self.rules = definition(self.rounds, config.nodes, config.seed, settings, shard_sizes=ctx.samples,
                                ranks=list(ctx.shard.ranks))
        self.network = ctx.network
        self.state = self.rules.begin(ctx.stacked.state)
        self._round: tuple[Round, tuple[float, ...], Links, Links, torch.Tensor] | None = None
        self._done_at: np.ndarray | None = None  # overlapping: when each node's exchange under way ends (modelled)

    def before_local_steps(self, iteration: int) -> None:
        self.rules.start_round(self.ctx.stacked.state, self.state, iteration)

    def aggregated(self, iteration: int) -> tuple[int, int] | None:
        return self.rules.span(iteration)

    def trainers(self, iteration: int) -> list[int] | None:
        chosen, shard = self.rules.trains(iteration), self.ctx.shard
        return None if chosen is None else [rank - shard.start for rank in chosen if shard.start <= rank < shard.stop]

    @torch.no_grad()
    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        nodes = self.ctx.config.nodes
        record = {"comm": np.zeros(nodes), "received": np.zeros(nodes, dtype=np.int64),
                  "missing": np.zeros(nodes, dtype=np.int64)}
        sent, first, clocks = None, None, self.ctx.clocks
        if self.rules.overlaps:  # the process engine's models, its exchange modelled beside the next local steps
            if self._done_at is not None:  # the exchange of the iteration before: waited for what it did not hide
                record["comm"] = np.maximum(0.0, self._done_at - clocks.now)
                clocks.now = np.maximum(clocks.now, self._done_at)
                self._done_at = None
            first = self.rules.exchange(iteration, 0)
            sent = self.rules.push(self.ctx.stacked.state, self.state, first,
                                   last=iteration + 1 == self.ctx.config.iterations)
            if sent is None:  # the last: the outcome of the one before, no new exchange
                return record
        started = clocks.now.copy()
        counts = {}
        for phase in range(self.rules.phases):
            exchange = first if phase == 0 and first is not None else self.rules.exchange(iteration, phase)
            for name, values in self._exchange(exchange, sent if phase == 0 else None).items():
                counts[name] = counts[name] + values if name in counts else values
        if self.rules.overlaps:  # the next steps start now; the exchange ends when it ends
            self._done_at, clocks.now = clocks.now.copy(), started
            counts["exchange"] = counts.pop("comm")
        return {**record, **{name: record[name] + values if name in record else values
                             for name, values in counts.items()}}

    def _exchange(self, exchange: Exchange, sent: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        """One exchange of the iteration, for every node (``sent``: its payload, where made already:
        an overlapped exchange's push)."""
        own = self.ctx.stacked.state
        everyone, links, own_weight = self._links(exchange)
        if sent is None:
            sent = self.rules.payload(own, self.state, exchange)
        self.network.carry(sent.shape[1] * sent.element_size())
        arrived, waited = self.network.gather(everyone.sender.cpu().numpy(), everyone.receiver.cpu().numpy(),
                                              self.silent())
        heard = torch.from_numpy(arrived).to(links.weight.device)[links.ids]
        weight, own_weight = heard_weights(links, own_weight, heard, exchange.keeps_missing)
        source = self.sources(sent, exchange.iteration)
        if self.rules.linear:
            mixed = weighted_sums(links, weight, own_weight, source, sent, self._fresh(sent, own))
            self.rules.merge(own, self.state, mixed, exchange)
        else:
            received, weights = links.stack(source[links.sender]), links.stack(weight)
            self.rules.merge_stack(own, self.state, sent, received, weights, own_weight, exchange)
        return {"comm": waited, **heard_counts(everyone, arrived)}

    def _fresh(self, sent: torch.Tensor, own: torch.Tensor) -> bool:
        """Whether the payload ``sent`` is a tensor of its own (not the models nor the definition's
        state), which the weighted sums may then be written into."""
        held = [own, *(value for value in self.state.values() if isinstance(value, torch.Tensor))]
        storage = sent.untyped_storage().data_ptr()
        return all(tensor.untyped_storage().data_ptr() != storage for tensor in held)

    def sources(self, sent: torch.Tensor, iteration: int) -> torch.Tensor:
        """The rows the links' senders index: this block's payloads ``sent``, then (under torchrun)
        those of the other blocks."""
        ctx = self.ctx
        return sent if ctx.plan is None else torch.cat([sent, ctx.collective.exchange(sent, ctx.plan)])

    def silent(self) -> np.ndarray | None:
        """Per link of the run, whether its receiver ignores it (None: none does)."""
        return None

    def links_of(self, exchange: Round) -> tuple[Links, Links]:
        """The round's links: every link of the run, and those into this process's nodes (the
        context's for the static graph's round, under torchrun too; others run in one process)."""
        if isinstance(self.rounds, StaticRounds) and exchange is self.rounds.round(0):
            return self.ctx.links, self.ctx.local
        links = Links.of_round(exchange, self.ctx.stacked.state.device)
        return links, links

    def _links(self, exchange: Exchange) -> tuple[Links, Links, torch.Tensor]:
        """``links_of`` the exchange's round and each node's own weight, as a tensor (the last
        exchange's again when its round and own weights are the same objects)."""
        cached = self._round
        if cached is None or cached[0] is not exchange.round or cached[1] is not exchange.own_weights:
            everyone, links = self.links_of(exchange.round)
            own = torch.tensor(exchange.own_weights, dtype=torch.float64, device=links.weight.device)
            self._round = cached = (exchange.round, exchange.own_weights, everyone, links, own)
        return cached[2:]


def heard_counts(links: Links, arrived: np.ndarray) -> dict[str, np.ndarray]:
    """Per node of the run, the links into it whose message ``arrived`` (``received``) and those
    whose did not (``missing``)."""
    receiver = links.receiver.cpu().numpy()
    received = np.bincount(receiver, weights=arrived, minlength=links.nodes).astype(np.int64)
    return {"received": received, "missing": np.bincount(receiver, minlength=links.nodes) - received}
