"""A requester: submits a training task to the network and gets the model and metrics back (``meshlearn request``).

``Requester`` wires one task's collaborators and drives them in ``run``: ``Planner`` (the data, the
estimate, what a provider needs), ``Claimer`` (the providers), ``DataServer`` (the task's files),
``Starter`` (assigned, started), ``Follower`` (statuses, the result, the settling) and ``Grower``
(newcomers taken in). Where the task stands is its ``TaskLifecycle``; what they share, ``TaskContext``.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from meshlearn.clock import SYSTEM, Clock
from meshlearn.data import Dataset
from meshlearn.network.channel.identity import KeyPair
from meshlearn.network.protocol.bootstrapapi import ProviderRecord
from meshlearn.network.requester.claiming import Claimer
from meshlearn.network.requester.context import Resume, Say, TaskContext
from meshlearn.network.requester.following import Follower
from meshlearn.network.requester.growing import Grower
from meshlearn.network.requester.lifecycle import TaskStage
from meshlearn.network.requester.links import BootstrapLink, ProviderLink
from meshlearn.network.requester.planning import Planner
from meshlearn.network.requester.serving import DataServer
from meshlearn.network.requester.starting import Starter
from meshlearn.network.task.datashare import FileShare
from meshlearn.network.task.results import plot_predictions
from meshlearn.network.task.spec import TaskRequest, new_task_id
from meshlearn.network.task.state import TaskRecord, secret_digest
from meshlearn.tblog import ScalarLog, run_folder

__all__ = ["Requester"]


class Requester:
    """Claims providers, serves them the data, starts the task, follows it and collects the result.

    It keeps the task's state in ``output``: its record (``task.json``) and the checkpoints its
    providers send (``taskstate``). ``resume``: the task of ``record`` goes on from its providers'
    checkpoints of these cycles (one per provider), kept in ``output`` (its providers then are
    asked for first)."""

    def __init__(self, request: TaskRequest, bootstrap: str, secret: bytes, output: Path,
                 host: str = "127.0.0.1", port: int = 0, say: Say = print, dataset: Dataset | None = None,
                 clock: Clock = SYSTEM, advertise: str = "", keys: KeyPair | None = None, tensorboard: str = "",
                 record: TaskRecord | None = None, resume: list[int] | None = None):
        self.task_id = record.task_id if record is not None else new_task_id()
        record = record or TaskRecord(self.task_id, request, secret_digest(secret, self.task_id))
        scalars = ScalarLog(run_folder(tensorboard, f"task-{self.task_id}")) if tensorboard else None
        self.ctx = TaskContext(request, record, secret, output, say, clock, BootstrapLink(bootstrap, secret, self.task_id),
                               ProviderLink(secret, self.task_id), keys=keys, resume=Resume.of(record, resume),
                               scalars=scalars)
        self.dataset = dataset  # the task's data, if the caller has loaded it already
        self.lifecycle = self.ctx.lifecycle
        self.planner = Planner(self.ctx)
        self.claimer = Claimer(self.ctx, self.planner)
        self.server = DataServer(self.ctx, host, port, advertise)
        self.starter = Starter(self.ctx, self.server, self.claimer)
        self.follower = Follower(self.ctx)
        self.grower = Grower(self.ctx, self.claimer, self.follower.statuses)

    def run(self) -> dict:
        """Run the task to the end; return its metrics (the result is written into ``output``)."""
        ctx, life = self.ctx, self.lifecycle
        claimed: list[ProviderRecord] = []
        # cleanup unwinds after the except clause: providers are told to cancel while the share
        # still serves them, so one caught mid-download stops cleanly instead of retrying a file that is gone
        with contextlib.ExitStack() as cleanup:
            try:
                dataset = self.planner.plan(self.dataset)
                ctx.write_record()  # from now on the task can be resumed (request --resume)
                life.move(TaskStage.CLAIMING)
                claimed.extend(self.claimer.claim())
                life.move(TaskStage.CLAIMED, f"{len(claimed)} provider(s)")
                self.claimer.check_enough(claimed)  # too few: given back as a failed task is
                share_dir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="meshlearn-share-")))
                share, address = self.server.open(claimed, dataset, cleanup)
                spec = self.starter.start(claimed, share, address, dataset, share_dir)
                life.move(TaskStage.RUNNING)
                metrics = self.follower.follow(spec, self.grower.take_in)
                life.move(TaskStage.SETTLING, f"result from {metrics.get('fetched_from')}")
                self.follower.settle(spec)
                life.move(TaskStage.DONE)
            except BaseException as exc:
                self._give_up(exc, claimed)
                raise
        return self._finish(metrics, dataset)

    def _give_up(self, error: BaseException, claimed: list[ProviderRecord]) -> None:
        """The task failed (or was interrupted) with ``error``: where it holds providers, each is
        told to drop it, the bootstrap to release it, and the dashboard why."""
        ctx, life = self.ctx, self.lifecycle
        interrupted = isinstance(error, KeyboardInterrupt)
        why = "interrupted on the requester's side" if interrupted else str(error) or type(error).__name__
        life.fail(why, cancelled=interrupted)
        if not life.holds_providers:  # nothing claimed: nothing to give back
            return
        ctx.providers.cancel(claimed)
        ctx.bootstrap.release("failed", sorted(ctx.roster.gone))
        ctx.watch.fault(f"task {life.stage.value}: {why}")
        ctx.watch.finish(None)
        life.move(TaskStage.RELEASED, "failed")

    def _finish(self, metrics: dict, dataset: Dataset | None) -> dict:
        """The task is done: its predictions drawn (where its data is here), the dashboard's last
        report, the bootstrap told (with the providers lost or left out), its record marked done."""
        ctx = self.ctx
        if dataset is not None:  # the providers are done: drawing the result's predictions holds none of them up
            plot_predictions(ctx.output, dataset, ctx.request.model, ctx.request.eval_samples, f"task {self.task_id}")
        ctx.watch.finish(metrics)
        lost = set(metrics.get("lost", [])) | set(ctx.roster.left_out) | ctx.roster.gone
        ctx.bootstrap.release("done", sorted(lost))
        self.lifecycle.move(TaskStage.RELEASED, "done")
        ctx.record.status = "done"
        ctx.write_record()
        ctx.kept.clear()  # a task that is done is never resumed: its checkpoints go
        return metrics

    def handlers(self, share: FileShare) -> dict:
        """The data server's dispatch table (``DataServer.handlers``)."""
        return self.server.handlers(share)

    def nearest(self) -> list[str]:
        """The free candidates' ids, nearest first (``Claimer.nearest``)."""
        return self.claimer.nearest()
