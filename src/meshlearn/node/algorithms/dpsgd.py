"""D-PSGD: after the local steps, send the model to every neighbour and take the
Metropolis-Hastings weighted average of what arrived. The plain average is the round runner's
(``RoundRunner``: static or dynamic rounds); this file adds the variants: lost UDP chunks, a
robust rule, a sharing scheme, and a bad node sending what its attack forges."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from meshlearn.aggregation.suspects import refusal
from meshlearn.definitions.averaging import masked_average_, merge_shares_
from meshlearn.definitions.base import Exchange
from meshlearn.definitions.dpsgd import (
    MISSING_CHUNK_RULES,
    DpsgdDefinition,
    MissingValueRule,
    robust_merge,
)
from meshlearn.definitions.settings import DpsgdSettings
from meshlearn.errors import ConfigError
from meshlearn.node.algorithms.base import AlgorithmContext
from meshlearn.node.algorithms.rounds import RoundRunner
from meshlearn.sharing import Shared, Sharing, make_sharing
from meshlearn.wire import Kind, Message

log = logging.getLogger(__name__)


class DPSGD(RoundRunner):
    """Synchronous decentralized parallel SGD (Lian et al. 2017), as in DecentralizePy.

    A neighbour whose model misses the deadline is left out of this iteration's average and
    its weight goes to the node's own model, so the weights still sum to one. Over a lossy
    transport, lost chunks (and wholly lost models) are averaged per chunk by ``missing_chunks``.
    With a robust ``aggregation`` rule the node applies it to its own model and those that arrived
    (per chunk of what arrived, over a lossy transport), with the same weights. A model holding
    NaN or Inf, or of another size or dtype, is refused before any rule sees it.

    In a group that takes in members as it runs (a network task's ``GrowingRounds``) every member
    takes a newcomer in at the round the requester named (``add_member``); the newcomer listens in
    the round before it (``start``: the members' models, averaged) and trains from that round on.

    With a ``sharing`` scheme other than ``full`` the node sends what the scheme makes of its model
    (a share of it, or a quantized copy) and averages each value over the neighbours that sent it,
    by the same ``missing_chunks`` rule; CHOCO-SGD makes its own update. With a peer sampler
    (``peer_sampling``) its peers and their weights change every iteration.
    """

    takes_lossy = True
    state_fields = (*RoundRunner.state_fields, "sharing")

    def __init__(self, ctx: AlgorithmContext):
        super().__init__(ctx, DpsgdDefinition)
        settings = ctx.settings or DpsgdSettings()
        self.missing_chunk_rule = MISSING_CHUNK_RULES[settings.missing_chunks]  # chosen once
        state = ctx.flat.state
        self.sharing: Sharing | None = None if ctx.sharing == "full" else \
            make_sharing(ctx.sharing, state.numel(), state.dtype, ctx.seed, ctx.transport.lossy)

    def start(self) -> None:
        if self.sharing is not None:
            self.sharing.start(self.ctx.flat.state)
        if self.ctx.joining:
            self._listen()

    def add_member(self, rank: int, address: str, at: int | None = None) -> None:
        if self.growing is None or at is None or self.sharing is not None or self.rule.robust:
            raise ConfigError("this D-PSGD run takes in no members as it runs: only a network task with free "
                              "slots does, at a round it names, with the full model and the mean")
        self.growing.join(rank, at)
        self.ctx.transport.add_peer(rank, address)

    def _listen(self) -> None:
        """A newcomer's start: the round before the one the group takes it in at, where it hears
        the members' models and takes the plain average of those that came (sending nothing)."""
        ctx, at = self.ctx, self.join_round
        if at is None or self.growing is None or at < 1:
            raise ConfigError("a node joining a D-PSGD group must be told the round it joins at (1 or later)")
        self.growing.join(ctx.rank, at)
        exchange = self.rules.exchange(at - 1)
        senders = list(exchange.round.receive_from[ctx.rank])
        received = ctx.transport.gather(at - 1, senders)
        own = ctx.flat.state.detach()
        usable = self.admit(received, lambda msg: self.payload_problem(msg, own, exchange))
        if not usable:
            raise ConfigError(f"a node joining at round {at} heard no member's model in round {at - 1}")
        own.copy_(torch.stack([self.vector(received[j], own) for j in usable]).mean(0))
        ctx.transport.recycle(received.values())
        self.joined_at = at

    def _exchange(self, exchange: Exchange, tag: int, sent: torch.Tensor | None = None) -> dict[str, float]:
        ctx = self.ctx
        if self.sharing is None and not (ctx.transport.lossy or self.rule.robust or ctx.attack is not None):
            return super()._exchange(exchange, tag, sent)  # the plain average
        iteration, links = exchange.iteration, _Links.of(exchange, ctx.rank)
        if self.sharing is not None:
            return self._exchange_shares(iteration, links)
        t0 = time.perf_counter()
        received = None
        if ctx.attack is not None and ctx.attack.rushing:
            # it sees its honest neighbours' models before it sends (and skips its colluders')
            received = ctx.transport.gather(iteration, [j for j in links.neighbours if j not in ctx.colluders])
        t1 = time.perf_counter()
        self._send(iteration, received, links)
        if received is None:
            received = ctx.transport.gather(iteration, links.neighbours)
        t2 = time.perf_counter()
        usable = self.admit(received, lambda msg: self._problem(msg, exchange))
        partial = [received[j] for j in usable if received[j].chunks is not None and received[j].chunks.missing]
        chunked = bool(partial) or (ctx.transport.lossy and bool(usable) and len(usable) < len(links.neighbours))
        own = ctx.flat.state.detach().unsqueeze(0)
        if self.rule.robust:
            self._aggregate_robust(usable, received, chunked, links)
        elif chunked:
            chunked_average_(ctx.flat.state, 1.0 - sum(links.weights.values()),
                             [(links.weights[j], received[j]) for j in usable], self.missing_chunk_rule)
        else:
            self._merge(own, own, received, usable, exchange)
        ctx.transport.recycle(received.values())
        t3 = time.perf_counter()
        return {"encode": t1 - t0, "comm": t2 - t1, "average": t3 - t2, "received": len(usable),
                "missing": len(links.neighbours) - len(usable), "partial": len(partial),
                "chunks_missing": sum(m.chunks.missing for m in partial)}

    def _exchange_shares(self, iteration: int, links: "_Links") -> dict[str, float]:
        """Send what the sharing scheme makes of the model, then average what the neighbours sent
        (each value over those who sent it), or let the scheme update the model (CHOCO-SGD). Over
        UDP a neighbour's message may come in part: the scheme reads what its rule can place."""
        ctx, sharing, state = self.ctx, self.sharing, self.ctx.flat.state
        t0 = time.perf_counter()
        tensors = sharing.encode(ctx.outgoing(state.detach(), iteration), ctx.rank, iteration)
        t1 = time.perf_counter()
        message = Message(Kind.MODEL, ctx.rank, iteration, len(links.neighbours), tensors)
        ctx.transport.broadcast(links.targets, message)
        received = ctx.transport.gather(iteration, links.neighbours)
        t2 = time.perf_counter()
        shared: dict[int, Shared] = {}
        partial = chunks_missing = 0
        for sender in sorted(received):
            msg = received[sender]
            chunks = None if msg.chunks is None else (msg.chunks.present, msg.chunks.chunk_bytes)
            try:
                share = sharing.receive(msg.tensors, sender, msg.iteration, chunks)
            except ValueError as exc:
                self.watch.refused(sender, str(exc))
                log.warning("node %d: refused the model of %d: %s", ctx.rank, sender, exc)
                continue
            self.watch.heard(sender)
            if msg.chunks is not None and msg.chunks.missing:
                partial, chunks_missing = partial + 1, chunks_missing + msg.chunks.missing
            if share is not None:
                shared[sender] = share
        degrees = {sender: received[sender].degree for sender in shared}
        for sender in merge_shares_(sharing, state, links.weights, shared, degrees, self.missing_chunk_rule):
            # expected over lossy links; the run log counts it (missing)
            log.debug("node %d: missed an update of %d: its estimate is out of step until each value is sent again",
                      ctx.rank, sender)
        ctx.transport.recycle(received.values())
        t3 = time.perf_counter()
        return {"encode": t1 - t0, "comm": t2 - t1, "average": t3 - t2, "received": len(shared),
                "missing": len(links.neighbours) - len(shared), "partial": partial, "chunks_missing": chunks_missing}

    def _send(self, iteration: int, received: dict[int, Message] | None, links: "_Links") -> None:
        """Send this node's model (or, for a bad node, what it forges) to every neighbour."""
        ctx, state = self.ctx, self.ctx.flat.state.detach()
        seen = None
        if received:
            seen = torch.stack([self.vector(received[j], state) for j in sorted(received)
                                if ctx.flat.check_compatible(received[j].tensors) is None])
        sent = state if ctx.attack is None else ctx.outgoing(state, iteration, seen)
        self.send(links.targets, sent, iteration, len(links.neighbours))

    def _problem(self, msg: Message, exchange: Exchange) -> str | None:
        """Why a received model of ``exchange`` must not be aggregated: another size or dtype, NaN or
        Inf (in the chunks that arrived, over a lossy transport); None if it may."""
        chunks = msg.chunks
        if chunks is None:
            return self.payload_problem(msg, self.ctx.flat.state, exchange)
        return self.ctx.flat.check_compatible(msg.tensors) or \
            refusal(chunks.vector, chunks.present, chunks.chunk_bytes // chunks.vector.element_size())

    def _aggregate_robust(self, usable: list[int], received: dict[int, Message], chunked: bool,
                          links: "_Links") -> None:
        """The node's model <- the rule over it and the models in ``usable`` (per chunk of what
        arrived, when ``chunked``): D-PSGD's ``robust_merge``, for this one node."""
        state = self.ctx.flat.state
        vectors = state.new_zeros((1, 0, state.numel())) if not usable else \
            torch.stack([self.vector(received[j], state) for j in usable]).unsqueeze(0).to(state.device)
        weights = torch.tensor([[links.weights[j] for j in usable]], dtype=torch.float64)
        present, chunk_elements = None, 0
        if chunked:
            present = torch.stack([received[j].chunks.present for j in usable]).unsqueeze(0).to(state.device)
            chunk_elements = received[usable[0]].chunks.chunk_bytes // state.element_size()
        result, deviant = robust_merge(self.rule, state.detach().unsqueeze(0), vectors, weights, present,
                                       chunk_elements)
        if deviant is not None:
            self.watch.count_deviant(usable, deviant[0])
        state.copy_(result[0])


def chunked_average_(state: torch.Tensor, own_weight: float, received: list[tuple[float, Message]],
                     rule: MissingValueRule) -> None:
    """In place: Metropolis-Hastings averaging where some chunks of some models are missing
    (``received``: each neighbour's weight and message; ``masked_average_`` per chunk)."""
    chunk_elements = received[0][1].chunks.chunk_bytes // state.element_size() if received else 1
    masked_average_(state, own_weight, [(weight, msg.degree, msg.chunks.vector, msg.chunks.present)
                                        for weight, msg in received], rule, chunk_elements)


@dataclass(frozen=True)
class _Links:
    """One node's links in one exchange: whom it sends to, whom it hears from, and each sender's
    weight, passed to every step of the exchange (none kept on the runtime between calls)."""

    targets: list[int]
    neighbours: list[int]
    weights: dict[int, float]

    @classmethod
    def of(cls, exchange: Exchange, rank: int) -> "_Links":
        peers = exchange.round
        return cls(list(peers.send_to[rank]), list(peers.receive_from[rank]), dict(peers.weights[rank]))
