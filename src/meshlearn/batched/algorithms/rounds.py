"""The batched engine's runtime for a ``RoundAlgorithm`` (``definitions``): its rules for every
node at once (B = N), each round's links gathered over the modelled network."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from meshlearn.aggregation.base import get_rule
from meshlearn.batched.algorithms.base import BatchedAlgorithm, BatchedContext, Traffic
from meshlearn.batched.byzantine import BadNodes
from meshlearn.batched.mixing import ChunkedMixing, Links, weighted_sums
from meshlearn.batched.robust import RobustMixing
from meshlearn.batched.sharing import SharedMixing
from meshlearn.definitions.base import Exchange, RoundAlgorithm
from meshlearn.definitions.exchange import merge_came, phases, run_exchanges
from meshlearn.definitions.mixing import with_mixing
from meshlearn.definitions.objective import weighted_optimizer
from meshlearn.errors import ConfigError
from meshlearn.topology.sampling import Round, StaticRounds, rounds_of


class BatchedRounds(BatchedAlgorithm):
    """Runs the ``RoundAlgorithm`` it is given (``definition``, its class) for every node. Each
    iteration, each of its exchanges: the definition's ``Exchange`` (the round's links and
    weights), every node's payload, who heard whom in time from the modelled network, and the
    definition's merge: for a ``linear`` one, of one sparse product (weights of late links zero);
    else of the stacked payloads each node received.

    The exchange features the definition's declaration takes work on its payloads: with a robust
    ``aggregation`` rule, in an exchange that ``pools``, each node's rule over its own payload and
    those that arrived is what its merge takes (``RobustMixing``); over a lossy network, the
    weighted sum per chunk of what arrived (``ChunkedMixing``, by the definition's
    ``missing_chunks`` rule); bad nodes (``byzantine``) send what their attack forges from their
    payload; a ``sharing`` scheme (D-PSGD's) replaces payload and merge with each node's scheme
    on its model (``SharedMixing``). Without any, the plain path: no more than the weighted sum.

    Under torchrun (a static graph) this process holds a block of the nodes: the links into it are
    ``ctx.local`` and the rows its links read (``sources``) are the block's payloads, then those
    the other blocks send, then its bad nodes' forged ones. Every process models the whole run's
    network (the same draws)."""

    state_fields = ("state", "_done_at", "variant")

    def __init__(self, ctx: BatchedContext, traffic: Traffic, definition: type[RoundAlgorithm]):
        self.name = definition.name
        super().__init__(ctx, traffic)
        config = ctx.config
        settings = config.settings_of(self.name) if definition.settings is not None else None
        self.rounds = rounds_of(config.peer_sampling, config.topology, ctx.graph, config.seed)
        self.rules = with_mixing(definition(self.rounds, config.nodes, config.seed, settings, shard_sizes=ctx.samples,
                                            ranks=list(ctx.shard.ranks)), config.mixing)
        self.network = ctx.network
        self.state = self.rules.begin(ctx.stacked.state)
        self._round: tuple[Round, tuple[float, ...], Links, Links, torch.Tensor] | None = None
        self._done_at: np.ndarray | None = None  # overlapping: when each node's exchange under way ends (modelled)
        self.bad = BadNodes(config, ctx.shard.start, ctx.stacked.state, ctx.links, ctx.local)
        self.lossy = ctx.network.lossy  # the configuration runs only a definition that declares it so
        self.variant: SharedMixing | RobustMixing | None = self._variant()  # None: the weighted sum
        self._chunked: tuple[Links | None, ChunkedMixing | None] = (None, None)  # the last links' (a cache)

    def _variant(self) -> SharedMixing | RobustMixing | None:
        """What replaces the weighted sum in this run: a sharing scheme, a robust rule, or nothing
        (ConfigError, in one line, where the definition's merge is not the weighted sum it needs)."""
        ctx, config, rules = self.ctx, self.ctx.config, self.rules
        state = ctx.stacked.state
        if config.sharing != "full":
            return SharedMixing(config.sharing, state, ctx.local, [ctx.graph.degree(i) for i in range(ctx.graph.n)],
                                rules.missing_chunks, config.seed, ctx.network.chunk_bytes)
        rule = get_rule(config.aggregation)
        problem = rules.merge_refusal(config.aggregation if rule.robust else "", self.lossy)
        if problem:
            raise ConfigError(problem)
        chunk_elements = ctx.network.chunk_bytes // state.element_size() if self.lossy else 0
        return RobustMixing(rule, config.nodes, chunk_elements) if rule.robust else None

    def local_optimizer(self, optimizer):
        return weighted_optimizer(self.rules.local_optimizer(optimizer, self.state), self.rules,
                                  self.ctx.config.objective)

    def before_local_steps(self, iteration: int) -> None:
        self.rules.start_round(self.ctx.stacked.state, self.state, iteration)

    def aggregated(self, iteration: int) -> tuple[int, int] | None:
        return self.rules.span(iteration)

    def trainers(self, iteration: int) -> list[int] | None:
        chosen, shard = self.rules.trains(iteration), self.ctx.shard
        return None if chosen is None else [rank - shard.start for rank in chosen if shard.start <= rank < shard.stop]

    @torch.no_grad()
    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        return run_exchanges(self.rules, self.ctx.stacked.state, self.state, iteration, self.ctx.config.iterations,
                             self._phases, self._join, self._overlap)

    def _phases(self, iteration: int, sent: torch.Tensor | None = None,
                first: Exchange | None = None) -> dict[str, np.ndarray]:
        """Every exchange of the iteration (``sent``: the first one's payload, where made already,
        for the exchange ``first``)."""
        return phases(self.rules, iteration, lambda exchange, tag, made: self._exchange(exchange, made), first, sent)

    def _join(self) -> dict[str, np.ndarray]:
        """The record of an iteration of an overlapping definition so far: ``comm``, each node's wait
        for what the local steps did not hide of the exchange of the iteration before (modelled)."""
        nodes, clocks = self.ctx.config.nodes, self.ctx.clocks
        record = {"comm": np.zeros(nodes), "received": np.zeros(nodes, dtype=np.int64),
                  "missing": np.zeros(nodes, dtype=np.int64)}
        if self._done_at is not None:
            record["comm"] = np.maximum(0.0, self._done_at - clocks.now)
            clocks.now = np.maximum(clocks.now, self._done_at)
            self._done_at = None
        return record

    def _overlap(self, exchanges: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Run ``exchanges`` now, modelled beside the next local steps: those start when they
        start, and the exchange ends when it ends (``_join`` waits for it). Its counters."""
        clocks = self.ctx.clocks
        started = clocks.now.copy()
        counts = exchanges()
        self._done_at, clocks.now = clocks.now.copy(), started
        return counts

    def _exchange(self, exchange: Exchange, sent: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        """One exchange of the iteration, for every node (``sent``: its payload, where made already:
        an overlapped exchange's push)."""
        if isinstance(self.variant, SharedMixing):
            return self._exchange_shares(exchange)
        own = self.ctx.stacked.state
        everyone, links, own_weight = self._links(exchange)
        if sent is None:
            sent = self.rules.payload(own, self.state, exchange)
        self.network.carry(sent.shape[1] * sent.element_size())
        silent = self.bad.silent(everyone) if self.bad.rushing else None  # the run's: the same in every process
        arrived, waited, columns = self._gather(everyone, self._chunks(sent), silent)
        present = torch.from_numpy(arrived).to(links.weight.device)[links.ids]
        source = self.sources(sent, exchange.iteration, links, silent)
        if self.bad:
            links = self.bad.reading(links)
        merge_came(self.rules, exchange, own, self.state, sent,
                   _LinksCame(self, links, own, sent, source, present, own_weight, everyone is self.ctx.links),
                   isinstance(self.variant, RobustMixing), present.dim() == 2)
        return {"comm": waited, **heard_counts(everyone, arrived.any(1) if arrived.ndim == 2 else arrived), **columns}

    def _exchange_shares(self, exchange: Exchange) -> dict[str, np.ndarray]:
        """An exchange with a sharing scheme (``SharedMixing``): what each node's scheme makes of
        its model, and its merge of what arrived of its neighbours' (the payload and merge of the
        definition are not used)."""
        everyone, links, _ = self._links(exchange)
        arrived, waited, columns = self._gather(everyone, self.variant.chunks, None)
        self.variant.mix_(self.ctx.stacked.state, torch.from_numpy(arrived).to(links.weight.device)[links.ids],
                          exchange.iteration)
        return {"comm": waited, **heard_counts(everyone, arrived.any(1) if arrived.ndim == 2 else arrived), **columns}

    def _gather(self, everyone: Links, chunks: int,
                silent: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Every link's message over the modelled network (``silent`` links send nothing): per link,
        whether it arrived in time (``chunks`` > 0: per link and chunk, whether each did), each
        node's waiting time, and the run log's columns of lost chunks."""
        sender, receiver = everyone.sender.cpu().numpy(), everyone.receiver.cpu().numpy()
        if not chunks:
            arrived, waited = self.network.gather(sender, receiver, silent)
            return arrived, waited, {}
        silent = np.zeros(len(sender), dtype=bool) if silent is None else silent
        present, waited, lost = self.network.gather_chunks(sender, receiver, chunks, silent)
        return present, waited, {"chunks_missing": lost}

    def _chunks(self, sent: torch.Tensor) -> int:
        """Chunks of a payload row of ``sent`` over a lossy network (0: messages arrive whole or not at all)."""
        if not self.lossy:
            return 0
        return -(-sent.shape[1] // (self.network.chunk_bytes // sent.element_size()))

    def _chunked_mixing(self, links: Links, static: bool) -> ChunkedMixing:
        """The per-chunk weighted sum over ``links`` (the senders' degrees: the graph's where ``static``)."""
        if self._chunked[0] is not links:
            chunk_elements = self.network.chunk_bytes // self.ctx.stacked.state.element_size()
            self._chunked = (links, ChunkedMixing(links, self.ctx.graph if static else None, self.rules.missing_chunks,
                                                  chunk_elements))
        return self._chunked[1]

    def _fresh(self, sent: torch.Tensor, own: torch.Tensor) -> bool:
        """Whether the payload ``sent`` is a tensor of its own (not the models nor the definition's
        state), which the weighted sums may then be written into."""
        held = [own, *(value for value in self.state.values() if isinstance(value, torch.Tensor))]
        storage = sent.untyped_storage().data_ptr()
        return all(tensor.untyped_storage().data_ptr() != storage for tensor in held)

    def sources(self, sent: torch.Tensor, iteration: int, links: Links | None = None,
                silent: np.ndarray | None = None) -> torch.Tensor:
        """The rows the links' senders index: this block's payloads ``sent``, then (under torchrun)
        those of the other blocks, then this block's bad nodes' forged rows (``links``: the
        exchange's into this block; ``silent``: per link of the run, whether its receiver ignores it)."""
        ctx, bad = self.ctx, self.bad
        if not bad and not bad.rushing:
            return self._rows(sent)
        seen = self._rows(sent) if bad.rushing else None  # every block exchanges as often
        if not bad:
            return self._rows(sent)
        forged = bad.forge(sent, iteration, links, silent, seen, self.rules.honest_tail)
        return torch.cat([self._rows(bad.sent(sent, forged)) if ctx.plan is not None else sent, forged])

    def _rows(self, sent: torch.Tensor) -> torch.Tensor:
        """This block's payload rows ``sent``, then (under torchrun) those the other blocks send."""
        ctx = self.ctx
        return sent if ctx.plan is None else torch.cat([sent, ctx.collective.exchange(sent, ctx.plan)])

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

    def peers_report(self) -> dict[int, dict]:
        return self.variant.reports() if isinstance(self.variant, RobustMixing) else {}


def heard_counts(links: Links, arrived: np.ndarray) -> dict[str, np.ndarray]:
    """Per node of the run, the links into it whose message ``arrived`` (``received``) and those
    whose did not (``missing``)."""
    receiver = links.receiver.cpu().numpy()
    received = np.bincount(receiver, weights=arrived, minlength=links.nodes).astype(np.int64)
    return {"received": received, "missing": np.bincount(receiver, minlength=links.nodes) - received}


class _LinksCame:
    """What came over an exchange's ``links`` into this block's nodes (``definitions.exchange.Came``):
    ``present`` per link (whole payloads) or per link and chunk, the links' senders reading
    ``source``; each node's payload row of ``sent`` and its ``own_weight``; ``static``: the
    links are the graph's."""

    def __init__(self, runner: BatchedRounds, links: Links, own: torch.Tensor, sent: torch.Tensor,
                 source: torch.Tensor, present: torch.Tensor, own_weight: torch.Tensor, static: bool):
        self.runner, self.links, self.own, self.sent, self.source = runner, links, own, sent, source
        self.present, self.own_weight, self.static = present, own_weight, static

    def weights(self) -> torch.Tensor:
        heard = self.present if self.present.dim() == 1 else self.present.any(1)
        return self.links.weight * heard.to(self.links.weight.dtype)

    def unheard(self, weights: torch.Tensor) -> torch.Tensor:
        return self.links.incoming(self.links.weight - weights)

    def chunked_sum(self) -> torch.Tensor:
        return self.runner._chunked_mixing(self.links, self.static).mixed(self.sent, self.present, self.source)

    def robust(self, weights: torch.Tensor, own_weight: torch.Tensor) -> torch.Tensor:
        return self.runner.variant.mixed(self.links, self.sent, self.source, self.present, weights, own_weight)

    def weighted_sum(self, weights: torch.Tensor, own_weight: torch.Tensor) -> torch.Tensor:
        return weighted_sums(self.links, weights, own_weight, self.source, self.sent,
                             self.runner._fresh(self.sent, self.own))

    def stack(self, weights: torch.Tensor, own_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.links.stack(self.source[self.links.sender]), self.links.stack(weights), own_weight
