"""The process engine's runtime for a ``RoundAlgorithm`` (``definitions``): its rules, for this
one node (B = 1), over the messages of each round. A payload travels as the state does: named
segments of at most ``flat.SEGMENT_BYTES``, copied into pooled buffers when it has the model's
size (no allocation per round)."""

from __future__ import annotations

import time
from typing import ClassVar

import torch

from meshlearn.aggregation.suspects import refusal
from meshlearn.definitions.base import Exchange, RoundAlgorithm
from meshlearn.errors import ConfigError
from meshlearn.flat import segment_ranges
from meshlearn.node.algorithms.base import Algorithm, AlgorithmContext
from meshlearn.threads import GuardedThread
from meshlearn.topology.sampling import GrowingRounds, StaticRounds
from meshlearn.transport import Transport
from meshlearn.wire import Kind, Message


class RoundRunner(Algorithm):
    """Runs the ``RoundAlgorithm`` it is given (``definition``, its class) for this node. Each
    iteration, each of its exchanges: the definition's ``Exchange`` (the round's peers and
    weights), the payload to every peer, the payloads of the round's senders gathered (a late or
    refused one weighs nothing), and the definition's merge over the stack of what came. A
    subclass that handles a lossy transport itself sets ``takes_lossy``."""

    endpoint = Transport
    talks_to = "neighbours"
    takes_lossy: ClassVar[bool] = False
    state_fields = ("state",)

    def __init__(self, ctx: AlgorithmContext, definition: type[RoundAlgorithm]):
        self.name = definition.name
        super().__init__(ctx)
        if ctx.transport.lossy and not self.takes_lossy:
            raise ConfigError(f"algorithm {self.name} needs transport tcp (it needs every message whole)")
        self.talks_to = definition.talks_to
        if ctx.sampler is not None and self.talks_to == "neighbours":  # peers that change every round
            self.talks_to = "everyone"
        self.growing = GrowingRounds(ctx.members) if ctx.members is not None and ctx.sampler is None \
            else None  # a network task's group (a complete graph) that takes in members as it runs
        rounds = ctx.sampler or self.growing or StaticRounds(ctx.graph)
        self.rules = definition(rounds, ctx.graph.n, ctx.seed, ctx.settings, shard_sizes=ctx.shard_sizes,
                                ranks=[ctx.rank])
        self.state = self.rules.begin(ctx.flat.state.detach().unsqueeze(0))
        self._buffer: torch.Tensor | None = None
        self._ranges: dict[int, dict[str, tuple[int, int]]] = {}
        self._pending: GuardedThread | None = None  # overlapping algorithms: the exchange running beside the steps
        self._counters: dict[str, float] = {}  # what the last one counted

    def before_local_steps(self, iteration: int) -> None:
        self.rules.start_round(self.ctx.flat.state.detach().unsqueeze(0), self.state, iteration)

    def aggregated(self, iteration: int) -> tuple[int, int] | None:
        return self.rules.span(iteration)

    def trains(self, iteration: int) -> bool:
        chosen = self.rules.trains(iteration)
        return chosen is None or self.ctx.rank in chosen

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        if not self.rules.overlaps:
            return self._phases(iteration)
        # the exchange of the iteration before ran beside these local steps: its outcome, then this one's push
        t0 = time.perf_counter()
        record = self._join()
        waited = time.perf_counter() - t0
        record["comm"] = waited  # what the local steps did not hide (the exchange's own time is in "exchange")
        first = self.rules.exchange(iteration, 0)
        with torch.no_grad():
            sent = self.rules.push(self.ctx.flat.state.detach().unsqueeze(0), self.state, first,
                                   last=iteration + 1 == self.ctx.iterations)
        if sent is not None:
            self._pending = GuardedThread(self._overlapped, f"exchange-{self.ctx.rank}", (iteration, sent, first))
            self._pending.start()
        return record

    def _phases(self, iteration: int, sent: torch.Tensor | None = None,
                first: Exchange | None = None) -> dict[str, float]:
        """Every exchange of the iteration (``sent``: the first one's payload, where made already,
        for the exchange ``first``)."""
        record = {"encode": 0.0, "comm": 0.0, "average": 0.0, "received": 0, "missing": 0}
        for phase in range(self.rules.phases):
            exchange = first if phase == 0 and first is not None else self.rules.exchange(iteration, phase)
            tag = iteration * self.rules.phases + phase
            for name, value in self._exchange(exchange, tag, sent if phase == 0 else None).items():
                record[name] = record.get(name, 0) + value
        return record

    def _overlapped(self, iteration: int, sent: torch.Tensor, first: Exchange) -> None:
        """The exchange thread's work: the iteration's exchanges, their counters kept for ``_join``."""
        with torch.no_grad():
            self._counters = self._phases(iteration, sent, first)

    def _join(self) -> dict[str, float]:
        """Wait for the exchange under way (raising what ended it, if it failed); its counters, the
        seconds it took as ``exchange`` ({} when none was under way)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return {}
        pending.join()
        pending.raise_if_failed()
        counters = dict(self._counters)
        counters["exchange"] = counters.pop("comm", 0.0)
        return counters

    def state_dict(self) -> dict:
        """The definition's state, once the exchange under way (if any) has written its outcome."""
        if self._pending is not None:
            self._pending.join()
        return super().state_dict()

    def stop(self) -> None:
        if self._pending is not None:
            self._join()
        super().stop()

    def check(self) -> None:
        super().check()
        if self._pending is not None:  # an overlapped exchange that failed is known at once, not at its join
            self._pending.raise_if_failed()

    def _exchange(self, exchange: Exchange, tag: int, sent: torch.Tensor | None = None) -> dict[str, float]:
        """One exchange of the iteration (``tag``: its number on the wire, one per phase; ``sent``:
        its payload, where made already: an overlapped exchange's push)."""
        ctx, rank = self.ctx, self.ctx.rank
        own = ctx.flat.state.detach().unsqueeze(0)
        t0 = time.perf_counter()
        if sent is None:
            with torch.no_grad():
                sent = self.rules.payload(own, self.state, exchange)
        t1 = time.perf_counter()
        senders = list(exchange.round.receive_from[rank])
        self.send(list(exchange.round.send_to[rank]), sent[0], tag, len(senders))
        received = ctx.transport.gather(tag, senders) if senders else {}
        t2 = time.perf_counter()
        admitted = set(self.admit(received, lambda msg: self.payload_problem(msg, sent[0], exchange)))
        usable = [sender for sender in senders if sender in admitted]
        self._merge(own, sent, received, usable, exchange)
        ctx.transport.recycle(received.values())
        t3 = time.perf_counter()
        return {"encode": t1 - t0, "comm": t2 - t1, "average": t3 - t2, "received": len(usable),
                "missing": len(senders) - len(usable)}

    def send(self, targets: list[int], payload: torch.Tensor, tag: int, degree: int) -> None:
        """Send ``payload`` [Q] to ``targets`` as named segments (a copy: the state changes while
        the transport may still be sending it; one from the pool where it has the model's size)."""
        flat, transport = self.ctx.flat, self.ctx.transport
        if payload.shape == flat.state.shape and payload.dtype == flat.state.dtype:
            segments = flat.snapshot(payload)
            flat.release(segments, transport.broadcast(targets, Message(Kind.MODEL, self.ctx.rank, tag, degree,
                                                                        segments)))
            return
        if payload.data_ptr() == flat.state.data_ptr():
            payload = payload.clone()
        transport.broadcast(targets, Message(Kind.MODEL, self.ctx.rank, tag, degree, self.segments(payload)))

    def segments(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """``vector`` cut into the wire's named segments (views)."""
        return {name: vector[a:b] for name, (a, b) in self.ranges(vector).items()}

    def ranges(self, vector: torch.Tensor) -> dict[str, tuple[int, int]]:
        """The segments' element ranges of a payload like ``vector`` (worked out once per size)."""
        if vector.numel() not in self._ranges:
            self._ranges[vector.numel()] = segment_ranges(vector.numel(), vector.element_size())
        return self._ranges[vector.numel()]

    def vector(self, msg: Message, like: torch.Tensor) -> torch.Tensor:
        """A received payload (segments of a payload ``like`` this node's) as one vector (the
        received buffer itself where it is one)."""
        if msg.chunks is not None:
            return msg.chunks.vector
        return torch.cat([msg.tensors[name] for name in self.ranges(like)])

    def payload_problem(self, msg: Message, sent: torch.Tensor, exchange: Exchange) -> str | None:
        """Why a received payload of ``exchange`` must not be merged (not this node's payload's
        segments, sizes and dtype, NaN or Inf, or what the definition refuses), or None."""
        tensors, ranges = msg.tensors, self.ranges(sent)
        if tensors.keys() != ranges.keys() or any(tensors[name].dtype != sent.dtype or tensors[name].shape != (b - a,)
                                                  for name, (a, b) in ranges.items()):
            return f"it sent {sorted(tensors)[:3]}, not {len(ranges)} segments of {sent.numel()} {sent.dtype} values"
        return next(filter(None, map(refusal, tensors.values())), None) or \
            self.rules.payload_problem(self.vector(msg, sent), exchange)

    def _merge(self, own: torch.Tensor, sent: torch.Tensor, received: dict[int, Message], usable: list[int],
               exchange: Exchange) -> None:
        """The definition's merge of this node's payload and the ``usable`` ones received."""
        heard_from = exchange.round.weights[self.ctx.rank]
        weights = [heard_from[sender] for sender in usable]
        own_weight = exchange.own_weights[0]
        if exchange.keeps_missing:  # the weight of a sender not heard stays with the node's own
            own_weight += sum(w for sender, w in heard_from.items() if sender not in usable)
        with torch.no_grad():
            if self.rules.linear:  # the weighted sum in place: into the model itself where the merge is to
                # take it and the payload is the model (D-PSGD), else into one buffer kept across rounds
                in_place = sent.data_ptr() == own.data_ptr() and type(self.rules).merge is RoundAlgorithm.merge
                mixed = own if in_place else self._mixed(sent)
                torch.mul(sent, own_weight, out=mixed)
                for sender, weight in zip(usable, weights):
                    for name, (a, b) in self.ranges(sent[0]).items():
                        mixed[0, a:b].add_(received[sender].tensors[name].to(mixed.device, non_blocking=True),
                                           alpha=weight)
                if not in_place:
                    self.rules.merge(own, self.state, mixed, exchange)
            else:
                stack = sent.new_zeros((1, 0, sent.shape[1])) if not usable else \
                    torch.stack([self.vector(received[sender], sent[0]) for sender in usable])[None].to(sent.device)
                self.rules.merge_stack(own, self.state, sent, stack, torch.tensor([weights], dtype=torch.float64),
                                       torch.tensor([own_weight], dtype=torch.float64), exchange)

    def _mixed(self, sent: torch.Tensor) -> torch.Tensor:
        """The buffer the weighted sum goes into (one, reused while the payload's shape holds)."""
        if self._buffer is None or self._buffer.shape != sent.shape or self._buffer.dtype != sent.dtype:
            self._buffer = torch.empty_like(sent)
        return self._buffer
