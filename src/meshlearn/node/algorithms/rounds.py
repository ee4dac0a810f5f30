"""The process engine's runtime for a ``RoundAlgorithm`` (``definitions``): its rules, for this
one node (B = 1), over the messages of each round. A payload travels as the state does: named
segments of at most ``flat.SEGMENT_BYTES``, copied into pooled buffers when it has the model's
size (no allocation per round).

The exchange features any definition's declaration (``needs``) may take work here on the
exchange's payload, not on the model: a lossy transport (each value over the senders whose chunk
of it came, by the definition's ``missing_chunks`` rule), a robust aggregation rule (in place of
the weighted sum, in an exchange that ``pools``), bad nodes (what each sends is what its attack
forges from its payload) and, for a definition that takes them, sharing schemes (which work on
the model: their own send and merge)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from meshlearn.aggregation.suspects import refusal
from meshlearn.definitions.averaging import take_shares_
from meshlearn.definitions.base import Exchange, RoundAlgorithm
from meshlearn.definitions.dpsgd import MISSING_CHUNK_RULES, robust_merge
from meshlearn.definitions.exchange import merge_came, phases, run_exchanges
from meshlearn.definitions.mixing import with_mixing
from meshlearn.definitions.objective import weighted_optimizer
from meshlearn.errors import ConfigError
from meshlearn.flat import segment_ranges
from meshlearn.node.algorithms.base import Algorithm, AlgorithmContext
from meshlearn.node.algorithms.dpsgd import chunked_average_
from meshlearn.sharing import Shared, Sharing, make_sharing
from meshlearn.threads import GuardedThread
from meshlearn.topology.sampling import GrowingRounds, StaticRounds
from meshlearn.transport import Transport
from meshlearn.wire import Kind, Message

log = logging.getLogger(__name__)


class RoundRunner(Algorithm):
    """Runs the ``RoundAlgorithm`` it is given (``definition``, its class) for this node. Each
    iteration, each of its exchanges: the definition's ``Exchange`` (the round's peers and
    weights), the payload to every peer, the payloads of the round's senders gathered (a late or
    refused one weighs nothing), and the definition's merge over what came: the weighted sum, or
    (see the module) the run's robust rule, the per-chunk sum of what a lossy transport delivered,
    or a sharing scheme's merge. A payload holding NaN or Inf, or of another size or dtype, is
    refused before any rule sees it.

    In a group that takes in members as it runs (a network task's ``GrowingRounds``) every member
    takes a newcomer in at the round the requester named (``add_member``); the newcomer listens in
    the round before it (``start``: the members' payloads, averaged) and trains from that round on.
    With a peer sampler (``peer_sampling``) its peers and their weights change every iteration."""

    endpoint = Transport
    talks_to = "neighbours"
    state_fields = ("state", "sharing")

    def __init__(self, ctx: AlgorithmContext, definition: type[RoundAlgorithm]):
        self.name = definition.name
        super().__init__(ctx)
        if ctx.transport.lossy and not definition.needs.lossy:
            raise ConfigError(f"algorithm {self.name} needs transport tcp (it needs every message whole)")
        self.talks_to = definition.talks_to
        if ctx.sampler is not None and self.talks_to == "neighbours":  # peers that change every round
            self.talks_to = "everyone"
        self.growing = GrowingRounds(ctx.members) if ctx.members is not None and ctx.sampler is None \
            else None  # a network task's group (a complete graph) that takes in members as it runs
        rounds = ctx.sampler or self.growing or StaticRounds(ctx.graph)
        self.rules = with_mixing(definition(rounds, ctx.graph.n, ctx.seed, ctx.settings, shard_sizes=ctx.shard_sizes,
                                            ranks=[ctx.rank]), ctx.mixing)
        self._refuse_unmergeable(ctx)
        self.state = self.rules.begin(ctx.flat.state.detach().unsqueeze(0))
        self.missing_chunk_rule = MISSING_CHUNK_RULES[self.rules.missing_chunks]  # over a lossy transport
        state = ctx.flat.state
        self.sharing: Sharing | None = None if ctx.sharing == "full" else \
            make_sharing(ctx.sharing, state.numel(), state.dtype, ctx.seed, ctx.transport.lossy)
        self._buffer: torch.Tensor | None = None
        self._ranges: dict[int, dict[str, tuple[int, int]]] = {}
        self._pending: GuardedThread | None = None  # overlapping algorithms: the exchange running beside the steps
        self._counters: dict[str, float] = {}  # what the last one counted

    def _refuse_unmergeable(self, ctx: AlgorithmContext) -> None:
        """ConfigError where the run's robust rule or lossy transport would have to replace a
        weighted sum the definition does not merge by (it merges a stack by its own rule)."""
        problem = self.rules.merge_refusal(ctx.rule if self.rule.robust else "", ctx.transport.lossy)
        if problem:
            raise ConfigError(problem)

    def start(self) -> None:
        if self.sharing is not None:
            self.sharing.start(self.ctx.flat.state)
        if self.ctx.joining and self._grows():
            self._listen()

    def _grows(self) -> bool:
        """Whether this runner's group takes in members as it runs (a network task's, exchanging
        with its members as neighbours; not a server's)."""
        return self.growing is not None and self.rules.talks_to == "neighbours"

    def add_member(self, rank: int, address: str, at: int | None = None) -> None:
        if not self._grows() or at is None or self.sharing is not None or self.rule.robust:
            raise ConfigError(f"this {self.name} run takes in no members as it runs: only a network task with free "
                              "slots does, at a round it names, with the full model and the mean")
        self.growing.join(rank, at)
        self.ctx.transport.add_peer(rank, address)

    def _listen(self) -> None:
        """A newcomer's start: the round before the one the group takes it in at, where it hears
        the members' models and takes the plain average of those that came (sending nothing)."""
        ctx, at = self.ctx, self.join_round
        if at is None or at < 1:
            raise ConfigError(f"a node joining a {self.name} group must be told the round it joins at (1 or later)")
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

    def local_optimizer(self, optimizer):
        return weighted_optimizer(self.rules.local_optimizer(optimizer, self.state), self.rules, self.ctx.objective)

    def before_local_steps(self, iteration: int) -> None:
        self.rules.start_round(self.ctx.flat.state.detach().unsqueeze(0), self.state, iteration)

    def aggregated(self, iteration: int) -> tuple[int, int] | None:
        return self.rules.span(iteration)

    def trains(self, iteration: int) -> bool:
        chosen = self.rules.trains(iteration)
        return chosen is None or self.ctx.rank in chosen

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        return run_exchanges(self.rules, self.ctx.flat.state.detach().unsqueeze(0), self.state, iteration,
                             self.ctx.iterations, self._phases, self._join, self._overlap)

    def _phases(self, iteration: int, sent: torch.Tensor | None = None,
                first: Exchange | None = None) -> dict[str, float]:
        """Every exchange of the iteration (``sent``: the first one's payload, where made already,
        for the exchange ``first``)."""
        return phases(self.rules, iteration, self._exchange, first, sent)

    def _overlap(self, exchanges: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Start ``exchanges`` on the exchange thread, beside the next local steps (its counters:
        at its ``_join``)."""
        self._pending = GuardedThread(self._overlapped, f"exchange-{self.ctx.rank}", (exchanges,))
        self._pending.start()
        return {}

    def _overlapped(self, exchanges: Callable[[], dict[str, float]]) -> None:
        """The exchange thread's work: the iteration's exchanges, their counters kept for ``_join``."""
        with torch.no_grad():
            self._counters = exchanges()

    def _join(self) -> dict[str, float]:
        """Wait for the exchange under way (raising what ended it, if it failed); its counters
        ({} when none was under way) and ``comm``, the seconds waited for it."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        counters = {}
        if pending is not None:
            pending.join()
            pending.raise_if_failed()
            counters = dict(self._counters)
        counters["comm"] = time.perf_counter() - t0  # what the local steps did not hide
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
        if self.sharing is not None:
            return self._exchange_shares(exchange, tag)
        ctx, rank = self.ctx, self.ctx.rank
        own = ctx.flat.state.detach().unsqueeze(0)
        t0 = time.perf_counter()
        if sent is None:
            with torch.no_grad():
                sent = self.rules.payload(own, self.state, exchange)
        t1 = time.perf_counter()
        senders = list(exchange.round.receive_from[rank])
        received = self._send(exchange, tag, sent, senders)
        if received is None:
            received = ctx.transport.gather(tag, senders) if senders else {}
        t2 = time.perf_counter()
        admitted = set(self.admit(received, lambda msg: self.payload_problem(msg, sent[0], exchange)))
        usable = [sender for sender in senders if sender in admitted]
        counts: dict[str, float] = {}
        chunked = False
        if ctx.transport.lossy:
            partial = [received[j] for j in usable if received[j].chunks is not None and received[j].chunks.missing]
            chunked = bool(partial) or (bool(usable) and len(usable) < len(senders))
            counts = {"partial": len(partial), "chunks_missing": sum(msg.chunks.missing for msg in partial)}
        with torch.no_grad():
            merge_came(self.rules, exchange, own, self.state, sent,
                       _Came(self, own, sent, received, usable, exchange, chunked), self.rule.robust, chunked)
        ctx.transport.recycle(received.values())
        t3 = time.perf_counter()
        return {"encode": t1 - t0, "comm": t2 - t1, "average": t3 - t2, "received": len(usable),
                "missing": len(senders) - len(usable), **counts}

    def _send(self, exchange: Exchange, tag: int, sent: torch.Tensor,
              senders: list[int]) -> dict[int, Message] | None:
        """Send the payload ``sent`` [1, Q] (a bad node: what its attack forges from it) to the
        exchange's targets. Returns the senders' messages where a rushing attack gathered them
        before it sent (its colluders' left out), else None."""
        ctx = self.ctx
        targets = list(exchange.round.send_to[ctx.rank])
        if ctx.transport.lossy and sent.shape[1] != ctx.flat.state.numel():
            raise ConfigError(f"algorithm {self.name} sends {sent.shape[1]} values, the model {ctx.flat.state.numel()}:"
                              " over transport udp a payload must have the model's size (use transport tcp)")
        if not ctx.bad or not targets:
            self.send(targets, sent[0], tag, len(senders))
            return None
        received, seen = self._rushing(tag, senders, sent[0]) if ctx.attack.rushing else (None, None)
        self.send(targets, ctx.bad.forged(sent, exchange.iteration, [seen], self.rules.honest_tail)[0], tag,
                  len(senders))
        return received

    def _rushing(self, tag: int, senders: list[int], like: torch.Tensor) -> tuple[dict[int, Message], torch.Tensor | None]:
        """A rushing bad node sees its honest senders' payloads (its colluders' left out) before it
        sends: their messages, and the payloads [D, Q] of those like its own (None: none)."""
        received = self.ctx.transport.gather(tag, [j for j in senders if j not in self.ctx.colluders])
        rows = [self.vector(received[j], like) for j in sorted(received) if self._shape_problem(received[j], like) is None]
        return received, torch.stack(rows) if rows else None

    def _exchange_shares(self, exchange: Exchange, tag: int) -> dict[str, float]:
        """Send what the sharing scheme makes of the model, then average what the senders sent
        (each value over those who sent it, by ``missing_chunks``; CHOCO-SGD: its own update). A
        share that lost chunks over UDP is still used: the scheme reads what its rule can place."""
        ctx, sharing, state = self.ctx, self.sharing, self.ctx.flat.state
        peers = exchange.round
        senders, weights = list(peers.receive_from[ctx.rank]), dict(peers.weights[ctx.rank])
        t0 = time.perf_counter()
        tensors = sharing.encode(ctx.outgoing(state.detach(), exchange.iteration), ctx.rank, exchange.iteration)
        t1 = time.perf_counter()
        ctx.transport.broadcast(list(peers.send_to[ctx.rank]), Message(Kind.MODEL, ctx.rank, tag, len(senders),
                                                                       tensors))
        received = ctx.transport.gather(tag, senders)
        t2 = time.perf_counter()
        taken = take_shares_(sharing, state, weights, [(j, self._share_of(received[j], j)) for j in sorted(received)],
                             {j: msg.degree for j, msg in received.items()}, self.missing_chunk_rule, self.refuse)
        for sender in taken.read:
            self.watch.heard(sender)
        chunks = [received[j].chunks for j in taken.read if received[j].chunks is not None]
        missing = [read.missing for read in chunks if read.missing]  # per message that lost chunks, how many
        for sender in taken.lost:  # expected over lossy links; the run log counts it (missing)
            log.debug("node %d: missed an update of %d: its estimate is out of step until each value is sent again",
                      ctx.rank, sender)
        ctx.transport.recycle(received.values())
        t3 = time.perf_counter()
        return {"encode": t1 - t0, "comm": t2 - t1, "average": t3 - t2, "received": len(taken.shared),
                "missing": len(senders) - len(taken.shared), "partial": len(missing), "chunks_missing": sum(missing)}

    def _share_of(self, msg: Message, sender: int) -> Callable[[], Shared | None]:
        """How this node's sharing scheme reads ``sender``'s message (what came of it)."""
        chunks = None if msg.chunks is None else (msg.chunks.present, msg.chunks.chunk_bytes)
        return lambda: self.sharing.receive(msg.tensors, sender, msg.iteration, chunks)

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
        segments, sizes and dtype, NaN or Inf in what arrived, or what the definition refuses), or None."""
        chunks = msg.chunks
        if chunks is None:
            refused = next(filter(None, map(refusal, msg.tensors.values())), None)
        else:  # only the chunks that arrived (the others read as zeros)
            refused = refusal(chunks.vector, chunks.present, chunks.chunk_bytes // chunks.vector.element_size())
        return self._shape_problem(msg, sent) or refused or self.rules.payload_problem(self.vector(msg, sent), exchange)

    def _shape_problem(self, msg: Message, sent: torch.Tensor) -> str | None:
        """Why a received payload is not made of this node's payload's segments, sizes and dtype, or None."""
        tensors, ranges = msg.tensors, self.ranges(sent)
        if tensors.keys() != ranges.keys() or any(tensors[name].dtype != sent.dtype or tensors[name].shape != (b - a,)
                                                  for name, (a, b) in ranges.items()):
            return f"it sent {sorted(tensors)[:3]}, not {len(ranges)} segments of {sent.numel()} {sent.dtype} values"
        return None

    def _in_place(self, own: torch.Tensor, sent: torch.Tensor) -> bool:
        """Whether the merge's input may be written into the model itself: the payload is the model
        and the definition's merge is to take the mixed payload as it is (D-PSGD)."""
        return sent.data_ptr() == own.data_ptr() and type(self.rules).merge is RoundAlgorithm.merge

    def _mixed(self, sent: torch.Tensor) -> torch.Tensor:
        """The buffer the weighted sum goes into (one, reused while the payload's shape holds)."""
        if self._buffer is None or self._buffer.shape != sent.shape or self._buffer.dtype != sent.dtype:
            self._buffer = torch.empty_like(sent)
        return self._buffer


class _Came:
    """What came to this node in one exchange (``definitions.exchange.Came``): the messages of
    its ``usable`` senders (``chunked``: some lost chunks over a lossy transport, or did not come)
    for its payload ``sent`` [1, Q]; each way of merging them over the messages' segments, into
    the model ``own`` itself where the runner may (``_in_place``), else into its kept buffer."""

    def __init__(self, runner: RoundRunner, own: torch.Tensor, sent: torch.Tensor, received: dict[int, Message],
                 usable: list[int], exchange: Exchange, chunked: bool):
        self.runner, self.own, self.sent, self.received, self.usable = runner, own, sent, received, usable
        self.heard_from, self.chunked = exchange.round.weights[runner.ctx.rank], chunked
        self.own_weight = exchange.own_weights[0]

    def weights(self) -> list[float]:
        return [self.heard_from[sender] for sender in self.usable]

    def unheard(self, weights: list[float]) -> float:
        return sum(w for sender, w in self.heard_from.items() if sender not in self.usable)

    def _into(self) -> torch.Tensor:
        """Where a sum goes: the model itself (``_in_place``), else the runner's buffer."""
        return self.own if self.runner._in_place(self.own, self.sent) else self.runner._mixed(self.sent)

    def chunked_sum(self) -> torch.Tensor:
        mixed = self._into()
        if mixed is not self.own:
            mixed.copy_(self.sent)
        chunked_average_(mixed[0], self.own_weight, [(w, self.received[j]) for j, w in zip(self.usable, self.weights())],
                         self.runner.missing_chunk_rule)
        return mixed

    def weighted_sum(self, weights: list[float], own_weight: float) -> torch.Tensor:
        mixed, sent = self._into(), self.sent
        torch.mul(sent, own_weight, out=mixed)
        for sender, weight in zip(self.usable, weights):
            for name, (a, b) in self.runner.ranges(sent[0]).items():
                mixed[0, a:b].add_(self.received[sender].tensors[name].to(mixed.device, non_blocking=True),
                                   alpha=weight)
        return mixed

    def _stacked(self) -> torch.Tensor:
        """The usable payloads as a stack [1, K, Q]."""
        sent = self.sent
        if not self.usable:
            return sent.new_zeros((1, 0, sent.shape[1]))
        return torch.stack([self.runner.vector(self.received[j], sent[0]) for j in self.usable])[None].to(sent.device)

    def stack(self, weights: list[float], own_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self._stacked(), torch.tensor([weights], dtype=torch.float64),
                torch.tensor([own_weight], dtype=torch.float64))

    def robust(self, weights: list[float], own_weight: float) -> torch.Tensor:
        """``robust_merge`` for this one node (per chunk of what arrived, when ``chunked``); the
        received payloads found deviant from its result are counted against their senders. A node
        that heard nobody keeps its weighted sum."""
        sent, received, usable = self.sent, self.received, self.usable
        if not usable:
            return self.weighted_sum(weights, own_weight)
        present, chunk_elements = None, 0
        if self.chunked:
            present = torch.stack([received[j].chunks.present for j in usable]).unsqueeze(0).to(sent.device)
            chunk_elements = received[usable[0]].chunks.chunk_bytes // sent.element_size()
        mixed, deviant = robust_merge(self.runner.rule, sent, self._stacked(),
                                      torch.tensor([weights], dtype=torch.float64), present, chunk_elements,
                                      own_weight=torch.tensor([own_weight], dtype=torch.float64))
        if deviant is not None:
            self.runner.watch.count_deviant(usable, deviant[0])
        return mixed
