"""Following a started task: its providers' statuses (one that stops answering is lost, one that
said it would go has left), its progress said as it changes, its result fetched from a provider
still in it, then the providers given a little time to end their part."""

from __future__ import annotations

import logging
from collections.abc import Callable

from meshlearn.errors import NetworkError, TaskFailed
from meshlearn.network.protocol.providerapi import RunStatus
from meshlearn.network.requester.context import (
    ENDED,
    POLL,
    SETTLE_EXTRA,
    STATUS_TIMEOUT,
    TaskContext,
)
from meshlearn.network.requester.results import fetch_results
from meshlearn.network.task.spec import Peer, TaskSpec

log = logging.getLogger(__name__)
JOIN_POLL = 1.0  # seconds between looks for a free provider to take into a task with a free slot
Statuses = list[tuple[Peer, RunStatus]]  # (provider, its task.status answer) of each provider still answering
Grow = Callable[[TaskSpec, Statuses], TaskSpec]  # takes a newcomer in where it can; the task's spec as it is now


class Follower:
    """Follows the task until a provider holds its result (``follow``), then until its providers end (``settle``)."""

    def __init__(self, ctx: TaskContext):
        self.ctx = ctx

    def follow(self, spec: TaskSpec, grow: Grow) -> dict:
        """The task's metrics, once a trusted provider holds its result (written into ``output``);
        ``grow`` is asked, every ``JOIN_POLL`` seconds where the task has slots, to take in a
        newcomer. TaskFailed when every provider is gone or all ended without a result."""
        ctx = self.ctx
        last_line, last_claim = "", ctx.clock.monotonic()
        while True:
            states = self.statuses(spec)
            if ctx.slots and ctx.clock.monotonic() - last_claim > JOIN_POLL:
                spec, last_claim = grow(spec, states), ctx.clock.monotonic()
            metrics = self._result(spec, states)
            if metrics is not None:
                return metrics
            if not states:
                raise TaskFailed(f"task {ctx.task_id}: every provider is gone; no result")
            if all(s.state in ENDED for _, s in states):
                raise TaskFailed(f"task {ctx.task_id} ended without a result: "
                                 + "; ".join(f"{p.id} {s.state}" + (f" ({s.error})" if s.error else "")
                                             for p, s in states))
            line = "  ".join(f"{p.id}: {s.state}" + _count(s.progress) for p, s in states)
            if line != last_line:
                ctx.say(f"task {ctx.task_id}: {line}")
                last_line = line
            ctx.clock.sleep(2 * POLL)

    def _result(self, spec: TaskSpec, states: Statuses) -> dict | None:
        """The result, from a provider that is still in the task (asked at this moment) and whose
        key was not revoked; None while none holds it."""
        ctx = self.ctx
        holders = [peer for peer, status in states if status.results]
        if not holders:
            return None
        revoked = ctx.roster.note_revoked(ctx.bootstrap.revoked())
        trusted = [peer for peer in holders if peer.id not in revoked]
        return fetch_results(ctx.task_id, trusted, ctx.secret, ctx.output, extra=ctx.roster.extra(),
                             name=self._result_name(spec))

    def settle(self, spec: TaskSpec) -> None:
        """Wait (a little) until every provider still answering has ended its part of the task,
        so none is shown busy once the result is in."""
        ctx = self.ctx
        deadline = ctx.clock.monotonic() + spec.peer_timeout + SETTLE_EXTRA
        while ctx.clock.monotonic() < deadline:
            if all(status.state in ENDED for _, status in self.statuses(spec)):
                return
            ctx.clock.sleep(POLL)
        log.warning("task %s: some providers did not end their part in time", ctx.task_id)

    def statuses(self, spec: TaskSpec) -> Statuses:
        """(provider, status) of every provider still answering; the others join ``gone``, except
        one whose part had ended or that said it was leaving (it goes once its part ends), or any
        once the result is in: those left, they were not lost."""
        ctx, roster = self.ctx, self.ctx.roster
        states = []
        for peer in spec.peers:
            if not roster.in_task(peer.id):
                continue
            try:
                status = ctx.providers.status(peer, timeout=STATUS_TIMEOUT)
                states.append((peer, status))
                roster.note_links(peer.id, status.progress)
                # a provider told to leave goes as soon as its part ends, maybe between two looks
                roster.ended[peer.id] = status.state in ENDED or status.leaving
            except NetworkError:  # gone, refusing, or its connection dropped mid-handshake
                self._gone(peer.id)
        ctx.watch.update(states)
        for pid in roster.revoked - roster.gone:  # told by the bootstrap, with a progress report
            ctx.lose(pid, "was revoked: it is out of the task")
        return [(peer, status) for peer, status in states if peer.id not in roster.gone]

    def _gone(self, provider: str) -> None:
        """``provider`` did not answer: it left (its part had ended, it said it would leave, the
        result is in, or the bootstrap saw it leave the network), else it is lost."""
        ctx = self.ctx
        if ctx.roster.ended.get(provider) or ctx.lifecycle.result_in or provider in ctx.bootstrap.left():
            ctx.roster.left.add(provider)
            ctx.say(f"task {ctx.task_id}: provider {provider} went, as it said it would (leaving), or after the result")
        else:
            ctx.lose(provider, "stopped answering")

    def _result_name(self, spec: TaskSpec) -> str:
        """The task as its confusion.png names it: its id, model, data and algorithm."""
        req = self.ctx.request
        return (f"task {self.ctx.task_id} ({req.model} on {req.data or req.data_on_providers}, {spec.algorithm}, "
                f"{len(spec.peers)} providers)")


def _count(progress: dict) -> str:
    """`` 7/10`` once a provider knows how many iterations its part has; nothing before."""
    total = progress.get("iterations")
    return f" {progress.get('iteration', 0)}/{total}" if total else ""
