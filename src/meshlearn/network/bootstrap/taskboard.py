"""What the bootstrap knows of tasks under way, as their requesters report it (``task.progress``):
each provider's progress, curves of train loss and test accuracy, faults (a lost provider, a
leader change) and the result's accuracy. Kept in memory, bounded in tasks and points: it is for
watching (the dashboard), not a record (the registry keeps each task's record and history)."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import BadMessage
from meshlearn.network.channel.envelope import field_of

TASKS_KEPT = 100
POINTS_KEPT = 2000  # iterations with a point, per task (the oldest go first)
FAULTS_KEPT = 100
CURVE_POINTS = 500  # points per curve sent to a page at most
MAX_PROVIDERS = 1024
_STATES = ("preparing", "ready", "training", "finishing", "done", "failed", "cancelled", "lost")
BEFORE_RESTART = "no live data: reported before the bootstrap restarted"
RUNNING_ACROSS_RESTART = ("no live data yet: the bootstrap restarted while this task ran (its requester's next report "
                          "shows here)")


def _number(body: dict, key: str) -> float | None:
    """A finite number or None (a diverged run's NaN loss is sent as None)."""
    value = field_of(body, key, (int, float, type(None)), None)
    if value is not None and not math.isfinite(value):
        raise BadMessage(f"field {key!r} must be a finite number")
    return value


def _count(body: dict, key: str) -> int:
    return field_of(body, key, int, 0, min_value=0)


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
    """Tasks' live state, by task id; ``report`` validates what a requester sends."""

    def __init__(self, clock: Clock = SYSTEM):
        self.clock = clock
        self.since = clock.time()  # what was reported before this (an earlier run of the bootstrap) is not here
        self._lock = threading.Lock()
        self._tasks: OrderedDict[str, _Task] = OrderedDict()

    def report(self, task_id: str, body: dict) -> None:
        """Apply one report: {"providers": {id: progress}, "faults": [text], "result": {"accuracy",
        "perplexity" (a language model's)}}."""
        providers = field_of(body, "providers", dict, {}, max_len=MAX_PROVIDERS)
        progress = {}
        for provider, state in providers.items():
            if not isinstance(provider, str) or len(provider) > 64 or not isinstance(state, dict):
                raise BadMessage("providers must map provider ids to their progress")
            kind = field_of(state, "state", str, "training", max_len=16)
            if kind not in _STATES:
                raise BadMessage(f"state {kind!r} is not one of {', '.join(_STATES)}")
            progress[provider] = {
                "state": kind, "iteration": _count(state, "iteration"), "iterations": _count(state, "iterations"),
                "train_loss": _number(state, "train_loss"), "test_acc": _number(state, "test_acc"),
                "evaluated_at": field_of(state, "evaluated_at", (int, type(None)), None, min_value=0),
                "leader": field_of(state, "leader", (str, type(None)), None, max_len=64)}
        faults = field_of(body, "faults", list, [], max_len=32)
        if not all(isinstance(f, str) and len(f) <= 256 for f in faults):
            raise BadMessage("faults must be short texts")
        result = field_of(body, "result", (dict, type(None)), None, max_len=8)
        accuracy = None if result is None else _number(result, "accuracy")
        perplexity = None if result is None else _number(result, "perplexity")
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
            task.faults += [{"at": self.clock.time(), "text": text} for text in faults]
            del task.faults[:-FAULTS_KEPT]
            if result is not None:
                task.result = {"accuracy": accuracy, **({"perplexity": perplexity} if perplexity is not None else {})}

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
