"""The bootstrap's requests about tasks: discovering providers, claiming them for a task (at once
and atomically), replacing those that could not take it, releasing them, a task's record and its
requester's progress reports."""

from __future__ import annotations

import logging

from meshlearn.errors import BadMessage
from meshlearn.network.bootstrap.registry import ProviderInfo, Registry
from meshlearn.network.bootstrap.taskboard import TaskBoard
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.channel.identity import key_in
from meshlearn.network.protocol.bootstrapapi import (
    Claim,
    ClaimReplace,
    Discover,
    Fit,
    Member,
    Noted,
    ProviderRecord,
    Providers,
    Release,
    Released,
    TaskName,
    TaskProgress,
    TaskRecord,
)

log = logging.getLogger(__name__)


def takes_part(record: dict, key: str) -> bool:
    """Whether ``key`` claimed the task of ``record`` or is the key of one of its providers."""
    return key == record["requester_key"] or key in {key_in(p["address"]) for p in record["providers"]}


class Claims:
    """Serves a requester's task requests (``discover``, ``claim``, ``claim.replace``, ``release``,
    ``task.progress``) and a task's record (``task``) against the registry; the progress goes to
    the dashboard's ``TaskBoard``."""

    def __init__(self, registry: Registry, board: TaskBoard):
        self.registry = registry
        self.board = board

    def discover(self, message: Discover, req: Envelope) -> Providers:
        """The registered providers that match a requester's filters (free ones only, unless told)."""
        return _listed(self.registry.discover(message.count, free_only=message.free_only, **_fit(message)))

    def claim(self, message: Claim, req: Envelope) -> Providers:
        """Free providers that match, claimed at once for the caller's task (in its preferred order)."""
        taken = self.registry.claim(message.task, req.sender[:128], message.count, requester_key=req.caller,
                                    order=list(message.order), attempt=message.attempt or "", **_fit(message))
        if not taken:
            raise BadMessage("no free provider matches the request: wait for one or relax --device, --location, "
                             "--min-ram or --min-cores")
        log.info("task %s claimed by %s (key %s): %s", message.task, req.sender[:128], req.caller,
                 ", ".join(p.id for p in taken))
        return _listed(taken)

    def claim_replace(self, message: ClaimReplace, req: Envelope) -> Providers:
        """The claiming requester drops providers that could not take its task (before it started)
        and claims others in their place, with the claim's own filters."""
        record = self._claimed_by_caller(message.task, req)
        members = {p["id"] for p in record["providers"]}
        if not all(p in members for p in message.drop):
            raise BadMessage("drop must list providers of this task")
        taken = self.registry.replace(record["id"], list(message.drop), message.count, exclude=list(message.exclude),
                                      **_fit(message))
        log.info("task %s: %s dropped before the start; in their place: %s", record["id"], ", ".join(message.drop),
                 ", ".join(p.id for p in taken) or "none free")
        return _listed(taken)

    def release(self, message: Release, req: Envelope) -> Released:
        """The claiming requester ends its task: its providers are freed, those it lost set aside."""
        record = self._claimed_by_caller(message.task, req)
        lost = list(message.lost)
        self.registry.release(record["id"], message.status, lost)
        log.info("task %s released (%s)%s", record["id"], message.status, f"; lost: {', '.join(lost)}" if lost else "")
        return Released(released=True)

    def task_progress(self, message: TaskProgress, req: Envelope) -> Noted:
        """A requester's report of its task (progress, faults, result), for the dashboard; the
        reply names the task's providers whose keys were revoked since (they are out of the task)."""
        record = self._claimed_by_caller(message.task, req)
        self.board.report(message)
        return Noted(noted=True, revoked=self._revoked_in(record))

    def task(self, message: TaskName, req: Envelope) -> TaskRecord:
        """A task's record, for its requester (``meshlearn results``) and its providers (who check
        an assignment against it): its providers, the key that claimed it, which were revoked and
        which left the network since it was claimed."""
        record = self.registry.task(message.task)
        if record is None or not takes_part(record, req.caller):
            raise BadMessage(f"task {message.task!r} is not one this key requested or was claimed for")
        left = self.registry.left_since([p["id"] for p in record["providers"]], record["created"])
        return TaskRecord(id=record["id"], requester=record["requester"],
                          providers=[Member(id=p["id"], address=p["address"]) for p in record["providers"]],
                          created=record["created"], status=record["status"], requester_key=record["requester_key"],
                          revoked=self._revoked_in(record), left=left)

    def _claimed_by_caller(self, task_id: str, req: Envelope) -> dict:
        """The record of task ``task_id``, if the caller's key claimed it (else refused)."""
        record = self.registry.task(task_id)
        if record is None or record["requester_key"] != req.caller:
            raise BadMessage(f"task {task_id!r} is not one this key requested")
        return record

    def _revoked_in(self, record: dict) -> list[str]:
        """The ids of a task's providers whose keys are revoked."""
        return [p["id"] for p in record["providers"] if self.registry.is_revoked(key_in(p["address"]))]


def _fit(message: Fit) -> dict:
    """What a discover or claim asks of providers, as ``Registry`` takes it: the device and
    location, the least RAM and cores, and whether other devices may fill in (``registry.select``)."""
    return {"device": message.device, "location": message.location, "min_ram_gb": message.min_ram_gb,
            "min_cores": message.min_cores, "fallback": message.fallback}


def _listed(providers: list[ProviderInfo]) -> Providers:
    """Providers as discovery and claims hand them out (their addresses pinned to their keys)."""
    return Providers(providers=[ProviderRecord(**p.public()) for p in providers])
