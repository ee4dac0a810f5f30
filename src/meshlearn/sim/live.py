"""Runs watched while they go on: a thread follows a run folder's logs (``RunWatch``) and hands
the new events to sinks: the dashboard's view of a run (``RunBoard``, of an experiment:
``ExperimentBoard``) and TensorBoard files (``sim.tbsink``). The logs are the one source: a
process run, a batched run and a run in a network namespace are watched alike."""

from __future__ import annotations

import math
import statistics
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Protocol

from meshlearn.config import ExperimentConfig
from meshlearn.runlog import LogTail
from meshlearn.sim.tables import PhaseTimes, evaluation_row
from meshlearn.sim.topologyfigure import ACCURACY_SPAN

NODE_TABLE_LIMIT = 64  # more nodes than this: the page shows the distribution, not a row per node
HISTOGRAM_BINS = 20
CURVE_POINTS = 500  # points per curve at most (longer runs are thinned evenly)
WATCH_EVERY = 0.5  # seconds between looks at the logs


class Sink(Protocol):
    """What a watcher feeds: every new event, in order per node; ``close()`` once the run ended."""

    def add(self, events: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class RunWatch:
    """Follows ``logs`` (a run's logs folder) from a thread; ``stop()`` reads what is left, so the
    sinks see every event the run wrote, then closes them."""

    def __init__(self, logs: str | Path, sinks: list[Sink], every: float = WATCH_EVERY):
        self.tail = LogTail(logs)
        self.sinks = sinks
        self.every = every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "RunWatch":
        self._thread = threading.Thread(target=self._loop, name="run-watch", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self._feed()

    def _feed(self) -> None:
        events = self.tail.read()
        if events:
            for sink in self.sinks:
                sink.add(events)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._feed()
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> "RunWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _thin(values: list, limit: int = CURVE_POINTS) -> list:
    if len(values) <= limit:
        return values
    step = len(values) / limit
    return [values[int(i * step)] for i in range(limit - 1)] + [values[-1]]


def _quantiles(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))] for q in (0, 0.1, 0.5, 0.9, 1.0)]


class RunBoard:
    """What the dashboard shows of one run, kept up to date from its log events: per node (or,
    for many nodes, the distribution) accuracy, loss, iteration time split, traffic, timeouts and
    lost chunks, and the curves of the honest nodes' mean."""

    def __init__(self, config: ExperimentConfig, name: str):
        self.config = config
        self.name = name
        self.status = "starting"
        self.attackers = config.attackers()
        self._lock = threading.Lock()
        self._nodes: dict[int, dict[str, Any]] = {}
        self._evals: dict[int, list[dict]] = defaultdict(list)
        self._bad_evals: dict[int, list[dict]] = defaultdict(list)
        self._train: dict[int, list[float]] = {}  # step -> [sum of train losses, count]
        self._phases = PhaseTimes()  # as iteration_time.png reads them
        self._epsilon: dict[int, float] = {}  # DP-SGD: each node's epsilon spent so far
        self._delta = config.dp.delta if config.dp.active else None

    def add(self, events: list[dict[str, Any]]) -> None:
        with self._lock:
            for event in events:
                self._add(event)

    def _node(self, rank: int) -> dict[str, Any]:
        return self._nodes.setdefault(rank, {"rank": rank, "iteration": 0, "test_acc": None, "test_loss": None,
                                             "test_perplexity": None, "train_loss": None, "bytes_sent": None, "timeouts": 0,
                                             "chunks_missing": 0, "bad": self.attackers.get(rank) and
                                             str(self.attackers[rank])})

    def _add(self, event: dict[str, Any]) -> None:
        kind, rank = event.get("event"), event.get("rank")
        if not isinstance(rank, int):
            return
        node = self._node(rank)
        if kind == "start":
            self.status = "running"
        elif kind == "iteration":
            step = int(event.get("iteration", 0)) + 1
            node["iteration"] = max(node["iteration"], step)
            self._phases.add(rank, event)
            node["timeouts"] += 1 if event.get("missing") else 0
            node["chunks_missing"] += int(event.get("chunks_missing") or 0)
            if event.get("bytes_sent") is not None:
                node["bytes_sent"] = event["bytes_sent"]
            loss = event.get("train_loss")
            if loss is not None and rank not in self.attackers:
                node["train_loss"] = loss
                total = self._train.setdefault(step, [0.0, 0])
                total[0] += loss
                total[1] += 1
        elif kind == "eval":
            node["test_acc"], node["test_loss"] = event.get("test_acc"), event.get("test_loss")
            if event.get("epsilon") is not None:  # DP-SGD: the budget spent so far
                self._epsilon[rank] = event["epsilon"]
            node["test_perplexity"] = event.get("test_perplexity")
            (self._bad_evals if rank in self.attackers else self._evals)[int(event["iteration"])].append(event)
        elif kind == "final":
            stats = event.get("stats") or {}
            node["bytes_sent"] = stats.get("bytes_sent", node["bytes_sent"])
            node["timeouts"] = stats.get("gather_timeouts", node["timeouts"])
            node["chunks_missing"] = stats.get("chunks_lost", node["chunks_missing"])
            privacy = event.get("privacy") or {}
            if privacy.get("epsilon") is not None:
                self._epsilon[rank], self._delta = privacy["epsilon"], privacy.get("delta")
            metrics = event.get("metrics") or {}
            if metrics:
                node["test_acc"], node["test_loss"] = metrics.get("accuracy"), metrics.get("loss")
                node["test_perplexity"] = metrics.get("perplexity")

    def close(self) -> None:
        self.finish()

    def finish(self, status: str = "done") -> None:
        """The run ended (``status``: done or failed)."""
        with self._lock:
            self.status = status

    def final_result(self) -> dict[str, float | None]:
        """The honest nodes' mean final accuracy so far, and perplexity (a language model's; None
        before any evaluation, or for a task without it)."""
        result = {}
        with self._lock:  # both from the same updates
            honest = [n for r, n in self._nodes.items() if r not in self.attackers]
            for key, field in (("accuracy", "test_acc"), ("perplexity", "test_perplexity")):
                values = [n[field] for n in honest if n[field] is not None]
                result[key] = statistics.fmean(values) if values else None
        return result

    def snapshot(self) -> dict[str, Any]:
        """The page's state: plain JSON values (no NaN: unknown values are null)."""
        with self._lock:
            c = self.config
            rows = [evaluation_row(it, self._evals[it], self._bad_evals.get(it) if self.attackers else None)
                    for it in sorted(self._evals)]
            train = sorted(self._train.items())
            nodes = [dict(n) for _, n in sorted(self._nodes.items())]
            per_node, phases = self._phases.per_node(), self._phases.overall()
            privacy = {"epsilon": max(self._epsilon.values()), "delta": self._delta} if self._epsilon else None
        for node in nodes:
            node["phases"] = per_node.get(node["rank"], {})
        rows = _thin(rows)
        train = _thin(train)
        perplexity = any("test_perplexity_mean" in r for r in rows) or any(n["test_perplexity"] is not None
                                                                            for n in nodes)
        metric = "test_perplexity" if perplexity else "test_acc"  # what the page leads with: the task's own metric
        values = [n[metric] for n in nodes if n[metric] is not None and math.isfinite(n[metric]) and not n["bad"]]
        many = c.nodes > NODE_TABLE_LIMIT
        state = {
            "kind": "run", "title": f"meshlearn run {self.name}", "name": self.name, "status": self.status,
            "config": {"algorithm": c.algorithm, "nodes": c.nodes, "iterations": c.iterations, "engine": c.engine,
                       "topology": c.topology, "dataset": c.dataset, "aggregation": c.aggregation},
            "iteration": min((n["iteration"] for n in nodes), default=0),
            "metric": "perplexity" if perplexity else "accuracy",
            "eval": {"iteration": [r["iteration"] for r in rows], "acc_mean": [_num(r["test_acc_mean"]) for r in rows],
                     "acc_std": [_num(r["test_acc_std"]) or 0.0 for r in rows],
                     "loss_mean": [_num(r["test_loss_mean"]) for r in rows],
                     **({"attackers_acc": [_num(r.get("attackers_acc_mean")) for r in rows]}
                        if self.attackers else {}),
                     **({"ppl_mean": [_num(r.get("test_perplexity_mean")) for r in rows],
                         "ppl_std": [_num(r.get("test_perplexity_std")) or 0.0 for r in rows]} if perplexity else {})},
            "train": {"iteration": [step for step, _ in train], "loss": [_num(s / n) for _, (s, n) in train]},
            "phases": phases,  # seconds per iteration, mean over every node's iterations so far
            "clock": "modelled" if c.engine == "batched" else "wall",
            "totals": {"bytes_sent": sum(n["bytes_sent"] or 0 for n in nodes),
                       "timeouts": sum(n["timeouts"] for n in nodes),
                       "chunks_missing": sum(n["chunks_missing"] for n in nodes)},
            "nodes": None if many else [{k: _num(v) for k, v in n.items()} for n in nodes],
        }
        if privacy:
            state["privacy"] = privacy
        if many and values:
            state["distribution"] = {"count": len(values), "quantiles": _quantiles(values),
                                     "histogram": value_histogram(values) if perplexity else accuracy_histogram(values)}
        return state


def accuracy_histogram(values: list[float], bins: int = HISTOGRAM_BINS) -> dict[str, list]:
    """{"edges", "counts"} of ``values`` (accuracies) in ``bins`` equal bins from a round number
    below the lowest to one above the highest, at least ``ACCURACY_SPAN`` wide (as topology.png's
    colours): nodes between 88% and 94% spread over the bins instead of filling one of 0-100%."""
    high = min(1.0, math.ceil(max(values) * 100 - 1e-9) / 100)
    low = max(0.0, math.floor(min(min(values), high - ACCURACY_SPAN) * 100 + 1e-9) / 100)
    high = max(high, low + 0.01)
    edges, counts = _binned(values, low, high, bins)
    return {"edges": [round(edge, 6) for edge in edges], "counts": counts}


def value_histogram(values: list[float], bins: int = HISTOGRAM_BINS) -> dict[str, list]:
    """{"edges", "counts"} of ``values`` (finite perplexities: no fixed range) in ``bins`` equal bins
    from the lowest to the highest (1% of the value wide where all are equal)."""
    low, high = min(values), max(values)
    edges, counts = _binned(values, low, max(high, low + 0.01 * max(abs(low), 1e-9)), bins)
    return {"edges": edges, "counts": counts}


def _binned(values: list[float], low: float, high: float, bins: int) -> tuple[list[float], list[int]]:
    """The edges of ``bins`` equal bins from ``low`` to ``high``, and how many values fall in each
    (those outside in the first or last)."""
    width = (high - low) / bins
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, max(0, int((value - low) / width)))] += 1
    return [low + i * width for i in range(bins + 1)], counts


def _num(value):
    """A value fit for JSON: NaN and infinities become null."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    return value


class ExperimentBoard:
    """What the dashboard shows of an experiment: every run's status and final accuracy, and the
    run under way (a ``RunBoard``)."""

    def __init__(self, name: str, runs: list[str]):
        self.name = name
        self._lock = threading.Lock()
        self._runs = {run: {"name": run, "status": "waiting", "accuracy": None, "perplexity": None} for run in runs}
        self._current: RunBoard | None = None

    def begin(self, name: str, config: ExperimentConfig) -> RunBoard:
        """Run ``name`` starts: its board becomes the current one."""
        board = RunBoard(config, name)
        with self._lock:
            self._current = board
            self._runs[name]["status"] = "running"
        return board

    def end(self, name: str, status: str = "done") -> None:
        with self._lock:
            board = self._current
        if board is not None:
            board.finish(status)
        with self._lock:
            self._runs[name].update(status=status, **(board.final_result() if board else {}))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            runs = [dict(r) for r in self._runs.values()]
            current = self._current
        return {"kind": "experiment", "title": f"meshlearn experiment {self.name}", "name": self.name,
                "runs": runs, "current": current.snapshot() if current is not None else None}
