"""The process engine's runtime for a ``RoundAlgorithm`` (``definitions``): its rules, for this
one node (B = 1), over the messages of each round."""

from __future__ import annotations

import time
from typing import ClassVar

import torch

from meshlearn.aggregation.suspects import refusal
from meshlearn.algorithms.base import Algorithm, AlgorithmContext
from meshlearn.definitions.base import RoundAlgorithm
from meshlearn.errors import ConfigError
from meshlearn.topology.sampling import Round, StaticRounds
from meshlearn.transport import Transport
from meshlearn.wire import Kind, Message

PAYLOAD = "payload"  # the one tensor of a round algorithm's message


class RoundRunner(Algorithm):
    """Each iteration: the round's peers from the definition, its payload to every peer, the
    payloads of the round's senders gathered (a late or refused one weighs nothing), and the
    definition's merge over the stack of what came. ``definition`` is set per algorithm
    (``definitions.base.engine_class``)."""

    definition: ClassVar[type[RoundAlgorithm]]
    endpoint = Transport
    talks_to = "neighbours"

    def __init__(self, ctx: AlgorithmContext):
        super().__init__(ctx)
        if ctx.transport.lossy:
            raise ConfigError(f"algorithm {self.name} needs transport tcp (it needs every message whole)")
        self.talks_to = self.definition.talks_to
        if ctx.sampler is not None and self.talks_to == "neighbours":  # peers that change every round
            self.talks_to = "everyone"
        rounds = ctx.sampler or StaticRounds(ctx.graph)
        self.rule = self.definition(rounds, ctx.graph.n, ctx.seed, ctx.settings, shard_sizes=ctx.shard_sizes,
                                    ranks=[ctx.rank])
        self.state = self.rule.begin(ctx.flat.state.detach().unsqueeze(0))
        self._buffer: torch.Tensor | None = None

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        record = {"encode": 0.0, "comm": 0.0, "average": 0.0, "received": 0, "missing": 0}
        for phase in range(self.rule.phases):
            self.rule.phase = phase
            for name, value in self._exchange(iteration, iteration * self.rule.phases + phase).items():
                record[name] += value
        return record

    def _exchange(self, iteration: int, tag: int) -> dict[str, float]:
        """One exchange of the iteration (``tag``: its number on the wire, one per phase)."""
        ctx, rank = self.ctx, self.ctx.rank
        own = ctx.flat.state.detach().unsqueeze(0)
        t0 = time.perf_counter()
        exchange = self.rule.round(iteration)
        with torch.no_grad():
            sent = self.rule.payload(own, self.state, iteration)
        if sent.data_ptr() == own.data_ptr():
            sent = sent.clone()  # the state changes while the transport may still be sending it
        t1 = time.perf_counter()
        senders = list(exchange.receive_from[rank])
        ctx.transport.broadcast(list(exchange.send_to[rank]),
                                Message(Kind.MODEL, rank, tag, len(senders), {PAYLOAD: sent[0]}))
        received = ctx.transport.gather(tag, senders) if senders else {}
        t2 = time.perf_counter()
        admitted = self._admit(received, sent[0])
        usable = [sender for sender in senders if sender in admitted]
        self._merge(own, sent, received, usable, exchange, iteration)
        ctx.transport.recycle(received.values())
        t3 = time.perf_counter()
        return {"encode": t1 - t0, "comm": t2 - t1, "average": t3 - t2, "received": len(usable),
                "missing": len(senders) - len(usable)}

    def _merge(self, own: torch.Tensor, sent: torch.Tensor, received: dict[int, Message], usable: list[int],
               exchange: Round, iteration: int) -> None:
        """The definition's merge of this node's payload and the ``usable`` ones received."""
        rank = self.ctx.rank
        weights = [exchange.weights[rank][sender] for sender in usable]
        own_weight = self.rule.own_weights(exchange, [rank])[0]
        if self.rule.keeps_missing:  # the weight of a sender not heard stays with the node's own
            own_weight += sum(w for sender, w in exchange.weights[rank].items() if sender not in usable)
        with torch.no_grad():
            if self.rule.linear:  # the weighted sum in place, into one buffer kept across rounds
                mixed = self._mixed(sent)
                torch.mul(sent, own_weight, out=mixed)
                for sender, weight in zip(usable, weights):
                    mixed[0].add_(received[sender].tensors[PAYLOAD], alpha=weight)
                self.rule.merge(own, self.state, mixed, iteration)
            else:
                stack = torch.stack([received[sender].tensors[PAYLOAD] for sender in usable]).unsqueeze(0) \
                    if usable else sent.new_zeros((1, 0, sent.shape[1]))
                self.rule.merge_stack(own, self.state, sent, stack, torch.tensor([weights], dtype=torch.float64),
                                      torch.tensor([own_weight], dtype=torch.float64), iteration)

    def _mixed(self, sent: torch.Tensor) -> torch.Tensor:
        """The buffer the weighted sum goes into (one, reused while the payload's shape holds)."""
        if self._buffer is None or self._buffer.shape != sent.shape or self._buffer.dtype != sent.dtype:
            self._buffer = torch.empty_like(sent)
        return self._buffer

    def _admit(self, received: dict[int, Message], sent: torch.Tensor) -> set[int]:
        """The senders whose payload may be merged: one tensor of this node's payload's size and
        dtype, finite; the others are refused and counted."""

        def problem(msg: Message) -> str | None:
            payload = msg.tensors.get(PAYLOAD)
            if set(msg.tensors) != {PAYLOAD} or payload.dtype != sent.dtype or payload.shape != sent.shape:
                return f"it sent {sorted(msg.tensors)[:3]}, not one {PAYLOAD} of {sent.numel()} {sent.dtype} values"
            return refusal(payload)

        return set(self.admit(received, problem))
