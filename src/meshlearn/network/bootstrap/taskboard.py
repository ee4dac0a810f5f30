"""What the bootstrap knows of tasks under way, as their requesters report it (``task.progress``):
each provider's progress, curves of train loss and test accuracy, faults (a lost provider, a
leader change) and the result's accuracy. Kept in memory, bounded in tasks and points: it is for
watching (the dashboard), not a record (the registry keeps each task's record and history)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from meshlearn.clock import SYSTEM, Clock
from meshlearn.network.protocol.bootstrapapi import TaskProgress

TASKS_KEPT = 100
POINTS_KEPT = 2000  # iterations with a point, per task (the oldest go first)
FAULTS_KEPT = 100
CURVE_POINTS = 500  # points per curve sent to a page at most
BEFORE_RESTART = "no live data: reported before the bootstrap restarted"
RUNNING_ACROSS_RESTART = ("no live data yet: the bootstrap restarted while this task ran (its requester's next report "
                          "shows here)")


class _Task:
    def __init__(self) -> None:
        self.progress: dict[str, dict[str, Any]] = {}
        self.points: OrderedDict[int, dict[str, list]] = OrderedDict()  # iteration -> provider -> [loss, acc]
        self.faults: list[dict[str, Any]] = []
        self.result: dict[str, float] | None = None

    def point(self, iteration: int, provider: str, slot: int, value: float | None) -> None:
        if value is None:
            return
        at = self.points.get(iteration)
        if at is None:
            at = self.points[iteration] = {}
            if len(self.points) > POINTS_KEPT:
                self.points.popitem(last=False)
        at.setdefault(provider, [None, None])[slot] = value


class TaskBoard:
    """Tasks' live state, by task id, from their requesters' reports (validated by ``TaskProgress``)."""

    def __init__(self, clock: Clock = SYSTEM):
        self.clock = clock
        self.since = clock.time()  # what was reported before this (an earlier run of the bootstrap) is not here
        self._lock = threading.Lock()
        self._tasks: OrderedDict[str, _Task] = OrderedDict()

    def report(self, report: TaskProgress) -> None:
        """Apply one report of task ``report.task``: its providers' progress, faults, and result
        (accuracy, and a language model's perplexity)."""
        task_id = report.task
        progress = {provider: state.model_dump() for provider, state in report.providers.items()}
        result = report.result
        with self._lock:
            task = self._tasks.get(task_id)
            if task is None:
                task = self._tasks[task_id] = _Task()
                if len(self._tasks) > TASKS_KEPT:
                    self._tasks.popitem(last=False)
            for provider, state in progress.items():
                before = task.progress.get(provider, {})
                if state["iteration"] > before.get("iteration", 0):
                    task.point(state["iteration"], provider, 0, state["train_loss"])
                if state["evaluated_at"] is not None and state["evaluated_at"] != before.get("evaluated_at"):
                    task.point(state["evaluated_at"], provider, 1, state["test_acc"])
                task.progress[provider] = state
            task.faults += [{"at": self.clock.time(), "text": text} for text in report.faults]
            del task.faults[:-FAULTS_KEPT]
            if result is not None:
                task.result = {"accuracy": result.accuracy,
                               **({"perplexity": result.perplexity} if result.perplexity is not None else {})}

    def page_view(self, record: dict[str, Any]) -> dict[str, Any]:
        """What the page shows of a task of the registry (``record``: its id, status and ``created``)
        beside the record: its live ``view``; where none was reported to this board and the task is
        older than the board (its reports went to an earlier run of the bootstrap),
        ``{"live": False, "note": ...}`` saying so; else ({}: claimed, nothing reported yet) nothing."""
        view = self.view(record["id"])
        if view is not None:
            return {"live": True, **view}
        if record["created"] < self.since:
            return {"live": False, "note": RUNNING_ACROSS_RESTART if record["status"] == "running" else BEFORE_RESTART}
        return {}

    def view(self, task_id: str) -> dict[str, Any] | None:
        """The task's progress, curves ({"iteration": [...], "series": [{"provider", "train_loss",
        "test_acc"}]}, gaps as null), faults, result and leader; None if never reported."""
        with self._lock:
            task = self._tasks.get(task_id)
            if task is None:
                return None
            progress = {p: dict(s) for p, s in task.progress.items()}
            points = list(task.points.items())
            faults = list(task.faults)
            result = task.result
        points.sort()
        if len(points) > CURVE_POINTS:
            step = len(points) / CURVE_POINTS
            points = [points[int(i * step)] for i in range(CURVE_POINTS - 1)] + [points[-1]]
        providers = sorted({p for _, at in points for p in at} | set(progress))
        series = [{"provider": p,
                   "train_loss": [at.get(p, [None, None])[0] for _, at in points],
                   "test_acc": [at.get(p, [None, None])[1] for _, at in points]} for p in providers]
        leaders = [s["leader"] for s in progress.values() if s.get("leader")]
        return {"progress": progress, "curve": {"iteration": [i for i, _ in points], "series": series},
                "faults": faults, "result": result, "leader": max(set(leaders), key=leaders.count) if leaders else None}
