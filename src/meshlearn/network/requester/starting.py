"""Starting a task on its claimed providers: its spec (their shards written and served), every
provider assigned it and waited for until ready, one that cannot take it left out and replaced
(another attempt), then all told to start."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from meshlearn.data import Dataset
from meshlearn.errors import NetworkError, TaskFailed
from meshlearn.network.channel.identity import key_text
from meshlearn.network.protocol.bootstrapapi import ProviderRecord
from meshlearn.network.requester.claiming import Claimer
from meshlearn.network.requester.context import (
    ASSIGN_TIMEOUT,
    ENDED,
    POLL,
    READY_TIMEOUT,
    SETTLE_EXTRA,
    STATUS_TIMEOUT,
    TaskContext,
)
from meshlearn.network.requester.lifecycle import TaskStage
from meshlearn.network.requester.serving import DataServer
from meshlearn.network.task.datashare import FileShare, dataset_meta
from meshlearn.network.task.spec import WEIGHTS_FILE, Resumed, TaskSettings, TaskSpec
from meshlearn.wire.sealed import FrameSeal

MAX_STARTS_AT_ONCE = 16  # starts in flight together (a provider's links are punched as its start reaches it)


class Starter:
    """Brings the task from its claimed providers to started ones (``start``)."""

    def __init__(self, ctx: TaskContext, server: DataServer, claimer: Claimer):
        self.ctx = ctx
        self.server = server
        self.claimer = claimer

    def start(self, claimed: list[ProviderRecord], share: FileShare, address: str, dataset: Dataset | None,
              share_dir: Path) -> TaskSpec:
        """Start the task on the claimed providers. One that refuses it, cannot be reached or
        cannot prepare it is left out and, where a free provider matches, replaced by a fresh
        claim (added to ``claimed``): the others are told to drop this attempt, and the task starts
        again (new shards), as long as one is left. Each attempt is a run with an engine key of its
        own (``task_key``). Returns the spec that started (in the task's record)."""
        ctx = self.ctx
        plan = list(claimed)
        while True:
            ctx.lifecycle.move(TaskStage.ASSIGNING, f"attempt {ctx.lifecycle.attempts + 1} on {len(plan)} provider(s)")
            spec = self.spec(plan, share, address, dataset, share_dir / f"attempt-{ctx.lifecycle.attempts}")
            ctx.task_key = FrameSeal.new_key()  # this run's own: nothing sealed in an earlier attempt opens in it
            refused = self._assign_all(spec)
            if not refused:
                break
            plan = self._next_plan(plan, refused, claimed)
            self._drop_attempt(spec, plan)
        self._write_config(spec)
        self._start_all(spec)
        ctx.say(f"task {ctx.task_id}: started on {len(spec.peers)} provider(s)")
        ctx.lifecycle.move(TaskStage.STARTED)
        ctx.write_record(spec)
        return spec

    def _start_all(self, spec: TaskSpec) -> None:
        """Tell every provider to start, all at once (their links are punched through NATs from both
        ends at the same moment: one slow answer must not hold the others' starts back)."""
        ctx = self.ctx

        def start(peer) -> str | None:
            try:
                ctx.providers.start(peer, ctx.roster.engines, punch=ctx.roster.punch)
            except NetworkError as exc:
                return str(exc)
            return None
        with ThreadPoolExecutor(max_workers=min(MAX_STARTS_AT_ONCE, len(spec.peers)),
                                thread_name_prefix="start") as pool:
            failed = list(pool.map(start, spec.peers))
        for peer, why in zip(spec.peers, failed):
            if why is not None:  # it went between ready and start: the others go on without it
                ctx.lose(peer.id, f"did not take the start ({why})")

    def _next_plan(self, plan: list[ProviderRecord], refused: dict[str, str],
                   claimed: list[ProviderRecord]) -> list[ProviderRecord]:
        """The providers of the next attempt: ``plan`` without those ``refused`` (left out, saying
        why), with those claimed in their place; TaskFailed where none is left."""
        ctx = self.ctx
        ctx.roster.left_out.update(refused)
        for pid, why in refused.items():
            ctx.say(f"task {ctx.task_id}: provider {pid} {why}")
        plan = [p for p in plan if p.id not in refused] + self.claimer.replace(list(refused), claimed)
        if not plan:
            raise TaskFailed(f"task {ctx.task_id}: no provider could take it: "
                             + "; ".join(f"{pid} {why}" for pid, why in ctx.roster.left_out.items()))
        ctx.say(f"task {ctx.task_id}: starting again on {len(plan)} provider(s): " + ", ".join(p.id for p in plan))
        return plan

    def spec(self, plan: list[ProviderRecord], share: FileShare, address: str, dataset: Dataset | None,
             folder: Path) -> TaskSpec:
        """The task's spec over the providers of ``plan``, their shards written into ``folder``
        and added to ``share``; it becomes the attempt under way (``spec_now``)."""
        ctx, req = self.ctx, self.ctx.request
        data, meta, weights = {"mode": "local", "dataset": req.data_on_providers}, None, None
        if dataset is not None:
            folder.mkdir(parents=True)
            self.server.write_shards(share, dataset, max(len(plan), ctx.slots), folder)
            files = share.manifest()
            files.pop(WEIGHTS_FILE, None)
            data, meta = {"mode": "served", "address": address, "files": files}, dataset_meta(dataset)
        if req.weights:
            weights = {"address": address, **share.manifest()[WEIGHTS_FILE]}
        resumed = None
        if ctx.resume is not None:
            manifest = share.manifest()
            resumed = Resumed(cycles=ctx.resume.cycles, address=address,
                              files={name: manifest[name] for name in ctx.kept.files(ctx.resume.cycles)})
        ctx.spec_now = spec = TaskSpec(
            **req.fields_of(TaskSettings), task_id=ctx.task_id, slots=ctx.slots,
            peers=[{"id": p.id, "address": p.address} for p in plan], data=data, meta=meta,
            weights=weights, requester=ctx.sender,
            checkpoints_to=address if ctx.keeps_checkpoints else "", resume=resumed)
        previous = ctx.resume.providers if ctx.resume is not None else []
        if ctx.resume is not None and (len(plan) != len(previous) or spec.fingerprint() != ctx.resume.fingerprint):
            raise TaskFailed(f"task {ctx.task_id} resumes on its {len(previous)} providers' checkpoints: it "
                             f"has {len(plan)} provider(s) now, and must train as it did; start more providers, or "
                             "start the task afresh")
        return spec

    def _assign_all(self, spec: TaskSpec) -> dict[str, str]:
        """Give every provider of ``spec`` the task and wait until each is ready (its engine's
        address in the roster's ``engines``); returns why each one that could not be used was not
        (empty: all are ready)."""
        ctx = self.ctx
        peers = spec.peers
        refused: dict[str, str] = {}
        for peer in peers:
            try:
                ctx.providers.assign(peer, spec, key_text(ctx.task_key), timeout=ASSIGN_TIMEOUT)
            except NetworkError as exc:
                refused[peer.id] = f"refused the task or did not answer ({exc})"
        if refused:
            return refused
        deadline = ctx.clock.monotonic() + READY_TIMEOUT
        engines = ctx.roster.engines = {}
        punch = ctx.roster.punch = {}
        while len(engines) + len(refused) < len(peers):
            for i, peer in enumerate(peers):
                if str(i) in engines or peer.id in refused:
                    continue
                try:
                    status = ctx.providers.status(peer)
                except NetworkError as exc:
                    refused[peer.id] = f"stopped answering while it prepared the task ({exc})"
                    continue
                if status.state in ("failed", "cancelled"):
                    refused[peer.id] = f"could not prepare the task: {status.error or status.state}"
                elif status.state != "preparing":
                    engines[str(i)] = status.engine
                    if status.punch is not None:
                        punch[str(i)] = status.punch
            if ctx.clock.monotonic() > deadline:
                refused.update({p.id: "did not get ready in time (data download or model build)"
                                for i, p in enumerate(peers) if str(i) not in engines})
            ctx.clock.sleep(POLL)
        return refused

    def _drop_attempt(self, spec: TaskSpec, plan: list[ProviderRecord]) -> None:
        """Tell every provider of ``spec`` to drop that attempt (one left out may still be
        preparing it), and wait (a little) until those of ``plan`` have, so each takes the next."""
        ctx = self.ctx
        ctx.providers.cancel(spec.peers)
        deadline = ctx.clock.monotonic() + SETTLE_EXTRA
        for peer in plan:
            while ctx.clock.monotonic() < deadline:
                try:
                    if ctx.providers.status(peer, timeout=STATUS_TIMEOUT).state in ENDED:
                        break
                except NetworkError:
                    break
                ctx.clock.sleep(POLL)

    def _write_config(self, spec: TaskSpec) -> None:
        """The task as it started, in task.yaml of ``output``: its settings, data, weights and bootstrap."""
        req = self.ctx.request
        self.ctx.output.mkdir(parents=True, exist_ok=True)
        resolved = {"task": spec.settings(), "data": req.data, "weights": req.weights,
                    "data_on_providers": req.data_on_providers, "bootstrap": self.ctx.bootstrap.bootstraps.text,
                    "warnings": req.warnings}
        (self.ctx.output / "task.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
