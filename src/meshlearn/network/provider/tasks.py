"""A provider's tasks: the runs it holds, who may act on each, and the requests about them (from
the requester that claimed a task, and from the task's other providers)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from meshlearn.errors import BadMessage, NetworkError
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.channel.identity import KeyPair, peer_key
from meshlearn.network.protocol.bootstrapapi import TaskName, TaskRecord
from meshlearn.network.protocol.message import Message
from meshlearn.network.protocol.providerapi import (
    Assign,
    Cancelled,
    Join,
    Kept,
    Pong,
    Provider,
    Push,
    PushAnswer,
    ResultCopy,
    ResultMetrics,
    RunStatus,
    Start,
)
from meshlearn.network.protocol.rpcs import TASK
from meshlearn.network.task.access import TaskAccess
from meshlearn.network.task.results import read_results
from meshlearn.network.task.spec import TaskSpec

if TYPE_CHECKING:
    from meshlearn.network.provider.taskrun import ProviderContext, TaskRun

log = logging.getLogger(__name__)


def proven_caller(req: Envelope, keys: KeyPair | None) -> str | None:
    """The key the request's channel proved, as printed (None in plain mode, ``keys`` None:
    nothing to check)."""
    return None if keys is None else req.caller


class TaskDesk:
    """The runs of this provider (``runs``, ``current``: the latest) and the typed handlers of the
    requests about them (``serving.serve``): ``task.*`` from the requester that claimed a task,
    checked with the bootstrap on assignment, and ``agg.*`` from the task's providers."""

    def __init__(self, provider_id: str, keys: KeyPair | None, workdir: Path, leaving: threading.Event,
                 ask_bootstrap: Callable[..., Message], context: Callable[[], ProviderContext],
                 on_change: Callable[[TaskRun], None]):
        self.id = provider_id
        self.keys = keys
        self.workdir = workdir
        self.leaving = leaving  # the provider is leaving: no new task
        self.ask_bootstrap = ask_bootstrap  # (rpc, request model, timeout=...) -> the bootstrap's reply model
        self.context = context  # what a new run may use of the provider
        self.on_change = on_change
        self.runs: dict[str, TaskRun] = {}
        self.current: TaskRun | None = None
        self._lock = threading.Lock()

    def busy(self) -> bool:
        """Whether the latest run is still at work."""
        return self.current is not None and self.current.state.active

    def busy_with(self) -> str | None:
        """The id of the task at work here, if any."""
        return self.current.spec.task_id if self.busy() else None

    # ---- the requester's calls ---------------------------------------------------------------

    def assign(self, message: Assign, req: Envelope) -> RunStatus:
        """A task for this provider, once the bootstrap confirms the caller claimed it: its run
        starts preparing (the same run if the requester asks again)."""
        from meshlearn.network.provider.taskrun import (
            TaskRun,  # loads torch: not before a first task
        )

        spec = message.spec
        if message.task != spec.task_id:
            raise BadMessage(f"task.assign: task {message.task} comes with the spec of task {spec.task_id}")
        task_key = peer_key(message.key, "the task's key")
        access = self._claimed_for(spec, proven_caller(req, self.keys))
        with self._lock:
            earlier = self.runs.get(spec.task_id)
            if earlier is not None:
                earlier.access.require_requester(access.requester, "task.assign")
                if earlier.spec == spec and earlier.task_key == task_key:
                    return earlier.status()  # the requester asked again: the same run
                if earlier.state.active:  # still ending an earlier attempt, sealed with that one's key
                    raise BadMessage(f"provider {self.id} is still ending an earlier attempt of task "
                                     f"{spec.task_id}: ask again in a moment")
            if self.leaving.is_set():
                raise BadMessage(f"provider {self.id} is leaving the network")
            if self.busy():
                raise BadMessage(f"provider {self.id} is busy with task {self.current.spec.task_id}")
            run = TaskRun(spec, self.context(), task_key, access, on_change=self.on_change,
                          fresh=earlier is not None)
            self.runs[spec.task_id] = self.current = run
        threading.Thread(target=run.run, name=f"task-{spec.task_id}", daemon=True).start()
        log.info("task %s accepted (provider %d of %d)", spec.task_id, run.index + 1, len(spec.peers))
        return run.status()

    def _claimed_for(self, spec: TaskSpec, caller: str | None) -> TaskAccess:
        """Who may act on the task ``spec`` describes, once the bootstrap confirms that ``caller``
        claimed it and claimed this provider for it (no check in plain mode)."""
        access = TaskAccess.of(spec, caller or "")
        if caller is None:
            return access
        try:
            record: TaskRecord = self.ask_bootstrap(TASK, TaskName(task=spec.task_id), timeout=10)
        except NetworkError as exc:
            raise BadMessage(f"task.assign refused: the bootstrap does not confirm task {spec.task_id} ({exc})") \
                from None
        if record.requester_key != caller:
            raise BadMessage(f"task.assign refused: task {spec.task_id} was claimed by another key")
        if self.id not in {member.id for member in record.providers}:
            raise BadMessage(f"task.assign refused: task {spec.task_id} did not claim provider {self.id}")
        ids = [p.id for p in spec.peers]
        if self.id not in ids or access.providers[ids.index(self.id)] != self.keys.text:
            raise BadMessage(f"task.assign refused: task {spec.task_id} does not list {self.id} with its key")
        return access

    def start(self, message: Start, req: Envelope) -> RunStatus:
        """The requester's go, with the engines' addresses (``TaskRun.start``)."""
        run = self._requesters_run(message.task, req)
        run.start(message.book(), message.joins_at, message.punches())
        return run.status()

    def join(self, message: Join, req: Envelope) -> RunStatus:
        """The requester takes another provider into its running task (``TaskRun.add_peer``), or
        withdraws one it took in (``TaskRun.withdraw``)."""
        run = self._requesters_run(message.task, req)
        if message.withdraw:  # some member could not take it in at its round: go on without it
            run.withdraw(message.peer)
            return run.status()
        run.add_peer(message.peer, message.engine, message.at)
        return run.status()

    def status(self, message: TaskName, req: Envelope) -> RunStatus:
        """Where the run stands, and whether this provider is leaving."""
        return self._requesters_run(message.task, req).status(leaving=self.leaving.is_set())

    def cancel(self, message: TaskName, req: Envelope) -> Cancelled:
        """The requester gives up on its task: the run stops (``TaskRun.cancel``)."""
        self._requesters_run(message.task, req).cancel()
        return Cancelled(cancelled=True)

    def results(self, message: TaskName, req: Envelope) -> tuple[ResultMetrics, list]:
        """A finished task's result, for its requester and its providers only (from disk: it
        outlives the run and a restart of this provider)."""
        task = message.task  # letters, digits, '-' and '_' only (TaskId): a folder's name, nothing more
        folder = self.workdir / "tasks" / task
        if (caller := proven_caller(req, self.keys)) is not None:
            access = TaskAccess.load(folder)
            if access is None:
                raise BadMessage(f"{self.id} holds no result for task {task}")
            access.require_member(caller, "task.results")
        found = read_results(folder / "result")
        if found is None:
            raise BadMessage(f"{self.id} holds no result for task {task} (yet)")
        metrics, model, settings = found
        kept = (settings or {}).get("task")  # the task's settings, as the result was written with them
        return ResultMetrics(metrics=metrics, task=kept if isinstance(kept, dict) else None), [model]

    # ---- the task's other providers' calls ---------------------------------------------------

    def push(self, message: Push, req: Envelope) -> PushAnswer:
        """A provider's final model (``agg.push``, ``Finisher.on_push``)."""
        return self._providers_run(message.task, req, message.index).on_push(message, req)

    def ping(self, message: Provider, req: Envelope) -> Pong:
        """A provider's sign of life (``agg.ping``, ``Finisher.on_ping``)."""
        return self._providers_run(message.task, req, message.index).on_ping(message, req)

    def take_results(self, message: ResultCopy, req: Envelope) -> Kept:
        """The leader's copy of the result (``agg.results``, ``Finisher.on_results``)."""
        return self._providers_run(message.task, req).on_results(message, req)

    # ---- who may act on a run ----------------------------------------------------------------

    def _run_of(self, task: str) -> TaskRun:
        run = self.runs.get(task)
        if run is None:
            raise BadMessage(f"task {task!r} is not running on {self.id}")
        return run

    def _requesters_run(self, task: str, req: Envelope) -> TaskRun:
        """The run of ``task``, if the caller of ``req`` is the key that claimed it."""
        run = self._run_of(task)
        if (caller := proven_caller(req, self.keys)) is not None:
            run.access.require_requester(caller, req.kind)
        return run

    def _providers_run(self, task: str, req: Envelope, index: int | None = None) -> TaskRun:
        """The run of ``task``, if the caller of ``req`` is one of its providers (the one of
        ``index``, where the request gives one)."""
        run = self._run_of(task)
        if (caller := proven_caller(req, self.keys)) is not None:
            run.access.provider_index(caller, req.kind, index)
        return run
