"""Growing a running task (``min_providers`` below ``providers``): while it has a free slot (never
filled, or its provider lost) and is not near its end, a free provider is claimed and taken in:
given the task (with ``joining``, and a lost provider's shard where it takes its place), the
running providers told of it (D-PSGD: at a round named ahead), then started with their engines."""

from __future__ import annotations

import math
from collections.abc import Callable

from meshlearn.errors import NetworkError
from meshlearn.network.channel.identity import key_text
from meshlearn.network.protocol.bootstrapapi import ProviderRecord
from meshlearn.network.requester.claiming import Claimer
from meshlearn.network.requester.context import (
    ASSIGN_TIMEOUT,
    POLL,
    READY_TIMEOUT,
    TaskContext,
)
from meshlearn.network.requester.following import Statuses
from meshlearn.network.requester.lifecycle import TaskStage
from meshlearn.network.task.spec import Peer, TaskSpec

JOIN_UNTIL = 0.8  # no provider joins a task whose slowest provider has done more than this share of its cycles
JOIN_LEAD = 2.0  # D-PSGD: seconds of training between naming a newcomer's round and the round's start


class Grower:
    """Takes newcomers into the running task (``take_in``); ``statuses`` polls its providers."""

    def __init__(self, ctx: TaskContext, claimer: Claimer, statuses: Callable[[TaskSpec], Statuses]):
        self.ctx = ctx
        self.claimer = claimer
        self.statuses = statuses

    def take_in(self, spec: TaskSpec, states: Statuses) -> TaskSpec:
        """Where a slot is free and the task not near its end, claim a free provider and take it
        in; returns the task's spec as it is now (with the newcomer if it joined)."""
        ctx = self.ctx
        progress = [s.progress for _, s in states if s.progress.get("iterations")]
        shard = self._free_shard(spec)
        if shard is None or not progress or ctx.roster.joins_closed or \
                min(p.get("iteration", 0) / p["iterations"] for p in progress) > JOIN_UNTIL:
            return spec
        peer = self.claimer.claim_one()
        if peer is None:
            return spec
        ctx.lifecycle.move(TaskStage.GROWING, f"taking in {peer.id}")
        started = ctx.clock.monotonic()
        try:
            joined = self._join(spec, peer, shard, (started, max(p.get("iteration", 0) for p in progress)))
        except NetworkError as exc:
            ctx.roster.left_out[peer.id] = f"could not join the running task ({exc})"
            ctx.providers.cancel([peer])
            ctx.say(f"task {ctx.task_id}: provider {peer.id} could not join: {exc}")
            ctx.lifecycle.move(TaskStage.RUNNING, f"{peer.id} could not join")
            return spec
        ctx.lifecycle.move(TaskStage.RUNNING, f"{peer.id} joined")
        self._say_joined(joined, shard, started)
        return joined

    def _join(self, spec: TaskSpec, peer: ProviderRecord, shard: int, seen: tuple[float, int]) -> TaskSpec:
        """Take ``peer`` in on ``shard`` (``seen``: when the task was last seen, and its round then);
        the spec with it, now the one under way (NetworkError where it could not join)."""
        ctx = self.ctx
        index = len(spec.peers)
        newcomer = Peer(id=peer.id, address=peer.address, shard=None if shard == index else shard)
        joined = spec.model_copy(update={"peers": [*spec.peers, newcomer], "joining": True})
        ctx.providers.assign(peer, joined, key_text(ctx.task_key), timeout=ASSIGN_TIMEOUT)
        engine = self._engine_of(peer)
        at = self._join_round(spec, seen) if ctx.request.algorithm == "dpsgd" else None
        took = []
        for member in spec.peers:
            if ctx.roster.in_task(member.id):
                try:
                    ctx.providers.join(member, newcomer, engine, at)
                    took.append(member)
                except NetworkError as exc:
                    if at is not None:  # a round already begun there: every member must take it in at one
                        self._withdraw(took, newcomer, engine, at)
                        raise NetworkError(f"{member.id} could not take it in at round {at} ({exc})") from None
                    ctx.lose(member.id, f"did not take in {peer.id} ({exc})")
        engines = {i: address for i, address in ctx.roster.engines.items()
                   if spec.peers[int(i)].id not in ctx.roster.gone}
        ctx.providers.start(peer, engines, joins_at=at)
        ctx.roster.engines[str(index)] = engine
        ctx.spec_now = joined = joined.model_copy(update={"joining": False})
        ctx.write_record(joined)  # the newcomer in its place: a resume claims it, not the provider it replaced
        return joined

    def _say_joined(self, spec: TaskSpec, shard: int, started: float) -> None:
        """Say that the task's last provider joined (in place of the lost provider whose shard it took)."""
        ctx, newcomer, index = self.ctx, spec.peers[-1], len(spec.peers) - 1
        instead = [p.id for i, p in enumerate(spec.peers[:-1]) if spec.shard_of(i) == shard and p.id in ctx.roster.gone]
        if instead:  # the lost provider whose shard it took
            ctx.roster.replaced[instead[-1]] = newcomer.id
        ctx.say(f"task {ctx.task_id}: provider {newcomer.id} joined as provider {index}"
                + (f" in place of {instead[-1]} (its shard)" if instead else "")
                + f" ({ctx.clock.monotonic() - started:.1f} s from its claim)")

    def _free_shard(self, spec: TaskSpec) -> int | None:
        """The shard a provider joining the task now trains on: the next slot's, else that of a
        provider the task lost (None: every slot is held)."""
        slots = self.ctx.slots
        if not slots:
            return None
        if len(spec.peers) < slots:
            return len(spec.peers)
        held = {spec.shard_of(i) for i, p in enumerate(spec.peers) if p.id not in self.ctx.roster.gone}
        return min(set(range(slots)) - held, default=None)

    def _join_round(self, spec: TaskSpec, seen: tuple[float, int]) -> int:
        """The round a D-PSGD newcomer joins at: ``JOIN_LEAD`` seconds of training after the round the
        fastest provider is at now, at the pace seen since ``seen`` (when, and the round it was at)."""
        now = self.ctx.clock.monotonic()
        progress = [s.progress for _, s in self.statuses(spec)]
        latest = max((p.get("iteration", 0) for p in progress), default=seen[1])
        pace = (latest - seen[1]) / max(now - seen[0], 1e-3)
        at = latest + 2 + math.ceil(pace * JOIN_LEAD)
        if at >= min((p.get("iterations", 0) for p in progress), default=0):
            raise NetworkError(f"the task ends before round {at}, the first it could join at")
        return at

    def _withdraw(self, took: list[Peer], newcomer: Peer, engine: str, at: int) -> None:
        """A newcomer some members could not take in at its round ``at``: the members that did go on
        without it (as without a revoked provider), and no other provider joins the task."""
        self.ctx.roster.joins_closed = True
        for member in took:
            try:
                self.ctx.providers.join(member, newcomer, engine, at, withdraw=True)
            except NetworkError as exc:
                self.ctx.lose(member.id, f"did not let {newcomer.id} go ({exc})")

    def _engine_of(self, peer: ProviderRecord) -> str:
        """The engine address of a provider preparing the task, once it is ready (NetworkError if it
        fails, takes too long, or says no engine address)."""
        ctx = self.ctx
        deadline = ctx.clock.monotonic() + READY_TIMEOUT
        while ctx.clock.monotonic() < deadline:
            status = ctx.providers.status(peer)
            if status.state in ("failed", "cancelled"):
                raise NetworkError(f"it could not prepare the task: {status.error or status.state}")
            if status.state != "preparing":
                if not status.engine:  # the members could not reach it
                    raise NetworkError("it is ready without an engine address")
                return status.engine
            ctx.clock.sleep(POLL)
        raise NetworkError("it did not get ready in time")
