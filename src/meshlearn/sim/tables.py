"""The report's tables: a run folder's per-node logs read as events and as arrays, summary.csv's
rows (one per evaluation), and where an iteration's time goes, phase by phase."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from meshlearn.runlog import COLUMNAR_LOG, per_node, read_jsonl

PHASES = ("train", "encode", "comm", "average", "eval")


def load_logs(output: Path) -> dict[int, list[dict[str, Any]]]:
    """Events of every node in a run folder, by rank: from each node's own log (process engine),
    or from the one columnar log of all nodes (batched engine)."""
    return _read_logs(output, expand_iterations=True)[0]


def read_run_logs(output: Path) -> tuple[dict[int, list[dict[str, Any]]], "Records"]:
    """What a report reads of a run folder: ``load_logs``' events, less the batched engine's
    ``iteration`` events, and every node's iteration events as arrays (``iteration_records``). The
    columnar ones go into the arrays as they are (100 events for 1,024 nodes and 100 iterations),
    never through the 102,400 per-node dictionaries ``load_logs`` would make of them."""
    logs, columnar = _read_logs(output, expand_iterations=False)
    return logs, iteration_records(logs, columnar)


def _read_logs(output: Path, expand_iterations: bool) -> tuple[dict[int, list[dict[str, Any]]], list[dict]]:
    """Events by rank, and the columnar ``iteration`` events left as they are (unless ``expand_iterations``)."""
    logs: dict[int, list[dict[str, Any]]] = {}
    columnar: list[dict] = []
    for path in sorted((Path(output) / "logs").glob("node_*.jsonl")):
        rank = int(path.stem.split("_")[1])
        logs[rank] = list(read_jsonl(path))
    batched = Path(output) / "logs" / COLUMNAR_LOG
    if batched.is_file():
        for event in read_jsonl(batched):
            if not expand_iterations and event.get("event") == "iteration" and "columns" in event:
                columnar.append(event)
                continue
            for one in per_node(event):
                logs.setdefault(one["rank"], []).append(one)
    return logs, columnar


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and standard deviation of ``values`` (NaN, NaN for none; std 0 for one; std NaN where a
    value is not finite)."""
    if not values:
        return float("nan"), float("nan")
    if len(values) == 1:
        return float(values[0]), 0.0
    array = np.asarray(values, dtype=np.float64)
    if not np.isfinite(array).all():  # a diverged run (inf or NaN loss) still gets its report
        return float(array.mean()), float("nan")
    return float(array.mean()), float(array.std())


def attackers_of(logs: dict[int, list[dict]]) -> dict[int, str]:
    """The run's bad nodes (``byzantine``) and their behaviours, from the nodes' start events."""
    found = {}
    for rank, events in logs.items():
        start = next((e for e in events if e.get("event") == "start"), {})
        if start.get("byzantine"):
            found[rank] = start["byzantine"]
    return found


def evaluation_table(logs: dict[int, list[dict]], records: Records | None = None) -> list[dict[str, float]]:
    """Per evaluation iteration: mean and std across the honest nodes of time, test accuracy and
    loss, and of their training loss since the evaluation before (``train_loss``: each node's mean
    over those iterations' local steps, where the run logged any); the bad nodes' mean accuracy
    apart, where there are any. ``records``: ``iteration_records(logs)``, where the caller has them."""
    attackers = attackers_of(logs)
    by_iteration: dict[int, list[dict]] = defaultdict(list)
    bad_by_iteration: dict[int, list[dict]] = defaultdict(list)
    for rank, events in logs.items():
        for event in events:
            if event.get("event") == "eval":
                (bad_by_iteration if rank in attackers else by_iteration)[event["iteration"]].append(event)
    iterations = sorted(by_iteration)
    training = _training_losses(records if records is not None else iteration_records(logs), attackers, iterations)
    rows = [evaluation_row(iteration, by_iteration[iteration], bad_by_iteration[iteration] if attackers else None)
            for iteration in iterations]
    if training is None:
        return rows
    placed = []
    for row, losses in zip(rows, training):  # beside the test loss
        mean, std = mean_std(losses)
        at = list(row).index("test_loss_std") + 1
        items = list(row.items())
        placed.append(dict(items[:at] + [("train_loss_mean", mean), ("train_loss_std", std)] + items[at:]))
    return placed


def _training_losses(records: Records, attackers: dict[int, str], iterations: list[int]) -> list[list[float]] | None:
    """For each evaluation after ``iterations[k]`` iterations: each honest node's mean training loss
    over the iterations since the evaluation before; None where the run logged no training loss."""
    kept = np.isfinite(records.train_loss) & ~np.isin(records.ranks, list(map(int, attackers)))
    if not kept.any():
        return None
    done, ranks, losses = records.iterations[kept] + 1, records.ranks[kept], records.train_loss[kept]
    windows, previous = [], 0
    for iteration in iterations:
        window = (done > previous) & (done <= iteration)
        nodes, inverse = np.unique(ranks[window], return_inverse=True)
        windows.append((np.bincount(inverse, weights=losses[window]) / np.bincount(inverse)).tolist()
                       if len(nodes) else [])
        previous = iteration
    return windows


# the batched engine's average model's fields of an eval event (summary.csv's columns), and their names in summary.json
AVERAGE_FIELDS = {"average_acc": "accuracy", "average_loss": "loss", "average_perplexity": "perplexity"}


def evaluation_row(iteration: int, group: list[dict], bad: list[dict] | None = None) -> dict[str, float]:
    """One row of summary.csv: the honest nodes' ``eval`` events of one iteration (``group``), as
    mean and std of time, test accuracy and loss, and the MB each had sent by then (where the
    engine counts it); ``bad``: the bad nodes' events, where a run has any."""
    t_mean, t_std = mean_std([e["t"] for e in group])
    a_mean, a_std = mean_std([e["test_acc"] for e in group])
    l_mean, l_std = mean_std([e["test_loss"] for e in group])
    row = {
        "iteration": iteration, "nodes": len(group), "time_mean": t_mean, "time_std": t_std,
        "test_acc_mean": a_mean, "test_acc_std": a_std, "test_loss_mean": l_mean, "test_loss_std": l_std,
    }
    if group and all("test_perplexity" in e for e in group):  # a language model's
        row["test_perplexity_mean"], row["test_perplexity_std"] = mean_std([e["test_perplexity"] for e in group])
    if group and all(e.get("bytes_sent") is not None for e in group):  # accuracy against bytes on the wire
        row["mb_sent_mean"] = statistics.fmean(e["bytes_sent"] for e in group) / 1e6
    if group and all("consensus" in e for e in group):  # the batched engine sees every model: how far apart they are
        row["consensus_distance"] = group[0]["consensus"]
    for name in AVERAGE_FIELDS:  # and their average's (the same in every node's event)
        if group and all(name in e for e in group):
            row[name] = group[0][name]
    for prefix in ("val", "shard"):  # a validation split (validation: SHARE); train_evaluate
        if group and all(f"{prefix}_acc" in e for e in group):
            row[f"{prefix}_acc_mean"], row[f"{prefix}_acc_std"] = mean_std([e[f"{prefix}_acc"] for e in group])
            row[f"{prefix}_loss_mean"] = mean_std([e[f"{prefix}_loss"] for e in group])[0]
    if bad is not None:
        row["attackers_acc_mean"] = mean_std([e["test_acc"] for e in bad])[0]
    return row


def phase_seconds(event: dict[str, Any]) -> list[float]:
    """An ``iteration`` event's seconds per phase, in ``PHASES`` order (a phase it does not give: 0)."""
    return [event.get(phase) or 0.0 for phase in PHASES]


class Records(NamedTuple):
    """Every ``iteration`` event of a run as arrays, one entry per event (``iteration_records``)."""

    ranks: np.ndarray  # [n] the node
    seconds: np.ndarray  # [n, len(PHASES)] the seconds of each phase
    evaluated: np.ndarray  # [n] whether the iteration ended with an evaluation
    iterations: np.ndarray  # [n] the iteration (from 0)
    train_loss: np.ndarray  # [n] the mean training loss of its local steps (NaN where none)


def iteration_records(logs: dict[int, list[dict]], columnar: list[dict] = ()) -> Records:
    """Every ``iteration`` event of a run's logs, and of the ``columnar`` ones (``read_run_logs``), as
    ``Records`` (one pass over the events, for 100,000 of them)."""
    records = [(rank, phase_seconds(event), event.get("eval") is not None, event.get("iteration", -1),
                _number(event.get("train_loss")))
               for rank, events in logs.items() for event in events if event.get("event") == "iteration"]
    parts = [tuple(np.asarray(column) for column in zip(*records))] if records else []
    parts += [_columnar_records(event) for event in columnar]
    if not parts:
        return Records(np.zeros(0, dtype=np.int64), np.zeros((0, len(PHASES))), np.zeros(0, dtype=bool),
                       np.zeros(0, dtype=np.int64), np.zeros(0))
    ranks, seconds, evaluated, iterations, losses = (np.concatenate(arrays) for arrays in zip(*parts))
    return Records(ranks.astype(np.int64), seconds.astype(np.float64).reshape(-1, len(PHASES)),
                   evaluated.astype(bool), iterations.astype(np.int64), losses.astype(np.float64))


def _number(value: Any) -> float:
    """A logged number, or NaN for none (null)."""
    return float("nan") if value is None else float(value)


def _columnar_records(event: dict[str, Any]) -> tuple[np.ndarray, ...]:
    """``iteration_records`` of one columnar ``iteration`` event: each field from its column, or the
    value the event shares for every node; a phase it does not give (or gives as null) counts 0."""
    ranks, columns = event["ranks"], event["columns"]

    def column(field: str) -> list:
        return columns[field] if field in columns else [event.get(field)] * len(ranks)

    seconds = np.array([[value or 0.0 for value in column(phase)] for phase in PHASES], dtype=np.float64).T
    return (np.asarray(ranks), seconds, np.array([value is not None for value in column("eval")], dtype=bool),
            np.asarray([-1 if value is None else value for value in column("iteration")]),
            np.array([_number(value) for value in column("train_loss")], dtype=np.float64))


def iteration_times(logs: dict[int, list[dict]], records: Records | None = None) -> dict[str, dict[str, float]]:
    """Median, mean and std of each phase of an iteration, of the whole, and of the overhead
    (encode + send/wait + average, i.e. the iteration minus training and evaluation), over all nodes.
    ``eval`` is over the iterations that evaluated (most do not: counted as 0 it had a median of 0).
    ``records``: ``iteration_records(logs)``, where the caller has them."""
    records = records or iteration_records(logs)
    seconds, evaluated = records.seconds, records.evaluated
    column = {phase: seconds[:, index] for index, phase in enumerate(PHASES)}
    phases = {**column, "eval": column["eval"][evaluated], "total": seconds.sum(1),
              "overhead": column["encode"] + column["comm"] + column["average"]}
    return {name: {"median": float(np.median(values)), "mean": float(values.mean()), "std": float(values.std())}
            for name, values in phases.items() if len(values)}


class PhaseTimes:
    """Where the nodes' iterations spend their time, gathered from ``iteration`` events as they come:
    each phase's seconds summed per node. The one rule behind ``iteration_time.png`` and the
    dashboard's time split (so the live page and the figure agree, modelled clocks included): a
    phase an event does not give counts 0, and a phase's share is its mean over the iterations
    (means add up to the mean iteration; medians would not)."""

    def __init__(self) -> None:
        self._sums: dict[int, list[float]] = {}  # rank -> seconds per phase, in PHASES order
        self._counts: dict[int, int] = defaultdict(int)

    def add(self, rank: int, event: dict[str, Any]) -> None:
        """Count one ``iteration`` event of node ``rank`` (other events are ignored)."""
        if event.get("event") != "iteration":
            return
        sums = self._sums.setdefault(rank, [0.0] * len(PHASES))
        for index, value in enumerate(phase_seconds(event)):
            sums[index] += value
        self._counts[rank] += 1

    @classmethod
    def of(cls, logs: dict[int, list[dict]], records: Records | None = None) -> PhaseTimes:
        """The phase times of a run's logs (``load_logs``), summed as arrays (``iteration_records``,
        or ``records`` where the caller has them)."""
        times = cls()
        records = records or iteration_records(logs)
        ranks, seconds = records.ranks, records.seconds
        unique, inverse = np.unique(ranks, return_inverse=True)
        sums = np.zeros((len(unique), len(PHASES)))
        np.add.at(sums, inverse, seconds)  # event after event, as ``add`` sums them
        for rank, total, count in zip(unique.tolist(), sums.tolist(), np.bincount(inverse).tolist()):
            times._sums[rank], times._counts[rank] = total, count
        return times

    def per_node(self) -> dict[int, dict[str, float]]:
        """Per node that logged an iteration: each phase's mean seconds per iteration."""
        return {rank: {phase: total / self._counts[rank] for phase, total in zip(PHASES, sums)}
                for rank, sums in sorted(self._sums.items())}

    def overall(self) -> dict[str, float]:
        """Each phase's mean seconds per iteration over every iteration of every node ({} before any)."""
        count = sum(self._counts.values())
        if not count:
            return {}
        return {phase: sum(sums[index] for sums in self._sums.values()) / count for index, phase in enumerate(PHASES)}
