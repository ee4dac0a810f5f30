"""Claiming a task's providers at the bootstrap: waiting (``--wait``) until enough are free, the
nearest first (``--prefer nearest``), a resumed task's own first, and fresh ones in place of
those that could not take it."""

from __future__ import annotations

import math
import secrets
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from meshlearn.errors import NetworkError, TaskFailed, UserInputError
from meshlearn.network.channel.identity import split_pinned
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.bootstrapapi import (
    Claim,
    ClaimReplace,
    Discover,
    ProviderRecord,
)
from meshlearn.network.requester.context import TaskContext
from meshlearn.network.requester.planning import Planner
from meshlearn.network.task.resources import wanted_device

NEAREST_CANDIDATES = 64  # free providers a requester preferring the nearest pings at most
PING_SAMPLES = 3  # round trips per candidate; the lowest counts
PING_THREADS = 16
WAIT_POLL = 1.0  # seconds between looks at the free providers while waiting for enough


class Claimer:
    """Claims the task's providers (``claim``) and others in place of some (``replace``)."""

    def __init__(self, ctx: TaskContext, planner: Planner):
        self.ctx = ctx
        self.planner = planner

    def claim(self) -> list[ProviderRecord]:
        """The providers the bootstrap gives the task, after the checks that need no claim."""
        ctx, req = self.ctx, self.ctx.request
        self.planner.refuse_too_big()
        if req.wait > 0:
            self._wait_for_providers()
        self.planner.say_skipped()
        order = self.nearest() if req.prefer == "nearest" else []
        previous = ctx.resume.providers if ctx.resume is not None else []
        if previous:  # a resumed task: its providers of then first, if they came back
            order = previous + [pid for pid in order if pid not in previous]
        claimed = ctx.bootstrap.providers(rpcs.CLAIM, Claim(task=ctx.task_id, **self.planner.wanted(req.providers),
                                                            order=order, attempt=secrets.token_hex(8)))
        claimed = in_places(claimed, previous)
        devices = Counter(p.device for p in claimed)
        ctx.say(f"task {ctx.task_id}: {len(claimed)} provider(s): " + ", ".join(p.id for p in claimed)
                + " (" + ", ".join(f"{n} {d}" for d, n in devices.most_common()) + ")")
        return claimed

    def check_enough(self, claimed: list[ProviderRecord]) -> None:
        """Refuse a claim of fewer providers than ``--min-providers`` (TaskFailed: the caller gives
        back what it holds), or say how many the task goes on with."""
        ctx, req = self.ctx, self.ctx.request
        if wanted_device(req.device):
            self.planner.say_devices(claimed)
        elif len(claimed) < req.providers:
            if ctx.slots and len(claimed) < (req.min_providers or 1):
                raise TaskFailed(f"task {ctx.task_id}: {len(claimed)} provider(s) free, fewer than --min-providers "
                                 f"{req.min_providers}: wait for more (--wait) or ask for fewer")
            ctx.say(f"only {len(claimed)} provider(s) available of the {req.providers} asked: using those"
                    + (", taking in more as they come free" if ctx.slots else ""))

    def replace(self, drop: list[str], claimed: list[ProviderRecord]) -> list[ProviderRecord]:
        """Give ``drop`` back to the bootstrap and claim as many free providers in their place
        (never one left out before); returns those claimed, also added to ``claimed``."""
        ctx, roster = self.ctx, self.ctx.roster
        try:
            fresh = ctx.bootstrap.providers(rpcs.CLAIM_REPLACE, ClaimReplace(
                task=ctx.task_id, drop=drop, **self.planner.wanted(len(drop)), exclude=sorted(roster.left_out)))
        except (TaskFailed, UserInputError) as exc:  # the task goes on with those it has
            ctx.say(f"task {ctx.task_id}: no provider in their place ({exc})")
            return []
        roster.replaced.update(zip(drop, (p.id for p in fresh)))
        roster.admitted.update(split_pinned(p.address)[1] for p in fresh)
        claimed.extend(fresh)
        ctx.say(f"task {ctx.task_id}: in place of {', '.join(drop)}: "
                + (", ".join(p.id for p in fresh) or "no free provider"))
        return fresh

    def claim_one(self) -> ProviderRecord | None:
        """A free provider claimed for the running task (never one it left out or lost); None if none is free."""
        ctx, roster = self.ctx, self.ctx.roster
        fresh = ctx.bootstrap.providers(rpcs.CLAIM_REPLACE, ClaimReplace(
            task=ctx.task_id, drop=[], **self.planner.wanted(1), exclude=sorted(set(roster.left_out) | roster.gone)))
        if not fresh:
            return None
        roster.admitted.add(split_pinned(fresh[0].address)[1])
        return fresh[0]

    def _wait_for_providers(self) -> None:
        """Wait (up to the request's ``wait``) until as many providers as asked are free (of the
        asked device, with the RAM and cores the task needs), saying how many are whenever that
        changes. Nothing is claimed meanwhile, so Ctrl-C leaves nothing behind."""
        ctx, req = self.ctx, self.ctx.request
        wanted = Discover(**self.planner.wanted(req.providers), free_only=True)  # with --device-fallback: any device
        device = wanted_device(req.device)
        kind = f"free {device} provider(s)" if device else "free provider(s)"
        deadline, said = ctx.clock.monotonic() + req.wait, None
        while True:
            free = len(ctx.bootstrap.providers(rpcs.DISCOVER, wanted))
            left = deadline - ctx.clock.monotonic()
            if free >= req.providers or left <= 0:
                return
            if free != said:
                ctx.say(f"waiting up to {left:.0f} s for {req.providers} {kind}: {free} now "
                        "(--wait 0 takes those free at once)")
                said = free
            ctx.clock.sleep(min(WAIT_POLL, left))

    def nearest(self) -> list[str]:
        """The free candidates' ids (up to NEAREST_CANDIDATES, with the request's filters), nearest
        first: by the lowest of a few round-trip times over the encrypted channel (a ping, a fresh
        connection each, as every task message makes); one that does not answer comes last."""
        found = self.ctx.bootstrap.providers(rpcs.DISCOVER, Discover(**self.planner.wanted(NEAREST_CANDIDATES),
                                                                     free_only=True))
        with ThreadPoolExecutor(max_workers=PING_THREADS) as pool:
            times = dict(zip((p.id for p in found), pool.map(self._round_trip, found)))
        order = sorted(times, key=times.get)
        if order:
            self.ctx.say("round-trip times: " + ", ".join(
                f"{pid} {times[pid] * 1000:.0f} ms" if math.isfinite(times[pid]) else f"{pid} no answer"
                for pid in order))
        return order

    def _round_trip(self, peer: ProviderRecord) -> float:
        """The lowest of ``PING_SAMPLES`` round-trip times to ``peer`` (inf if it does not answer)."""
        best = math.inf
        for _ in range(PING_SAMPLES):
            started = self.ctx.clock.monotonic()
            try:
                self.ctx.providers.ping(peer)
            except NetworkError:
                return math.inf
            best = min(best, self.ctx.clock.monotonic() - started)
        return best


def in_places(claimed: list[ProviderRecord], previous: list[str]) -> list[ProviderRecord]:
    """``claimed`` in position order: each of a resumed task's providers of then (``previous``, by
    position) that came back at its own position, the others in the positions left, in order."""
    back = {p.id: p for p in claimed if p.id in previous}
    others = iter([p for p in claimed if p.id not in back])
    placed = [back[pid] if pid in back else next(others, None) for pid in previous]
    return [p for p in placed if p is not None] + list(others)
