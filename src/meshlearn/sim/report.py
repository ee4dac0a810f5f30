"""Turn a run folder's per-node JSONL logs into summary.csv, summary.json and PNG plots."""

from __future__ import annotations

import csv
import itertools
import json
import math
import statistics
import textwrap
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import yaml

from meshlearn.errors import ConfigError, MeshlearnError
from meshlearn.plots import fit_title, pyplot, text_colour_on
from meshlearn.privacy.budget import privacy_summary
from meshlearn.runlog import COLUMNAR_LOG, per_node, read_jsonl

PHASES = ("train", "encode", "comm", "average", "eval")
RUN_TIMES = "run.json"  # written by the launcher: when it started, trained and finished (so wall-clock counts start-up)


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


def _mean_std(values: list[float]) -> tuple[float, float]:
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
        mean, std = _mean_std(losses)
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


def evaluation_row(iteration: int, group: list[dict], bad: list[dict] | None = None) -> dict[str, float]:
    """One row of summary.csv: the honest nodes' ``eval`` events of one iteration (``group``), as
    mean and std of time, test accuracy and loss, and the MB each had sent by then (where the
    engine counts it); ``bad``: the bad nodes' events, where a run has any."""
    t_mean, t_std = _mean_std([e["t"] for e in group])
    a_mean, a_std = _mean_std([e["test_acc"] for e in group])
    l_mean, l_std = _mean_std([e["test_loss"] for e in group])
    row = {
        "iteration": iteration, "nodes": len(group), "time_mean": t_mean, "time_std": t_std,
        "test_acc_mean": a_mean, "test_acc_std": a_std, "test_loss_mean": l_mean, "test_loss_std": l_std,
    }
    if group and all("test_perplexity" in e for e in group):  # a language model's
        row["test_perplexity_mean"], row["test_perplexity_std"] = _mean_std([e["test_perplexity"] for e in group])
    if group and all(e.get("bytes_sent") is not None for e in group):  # accuracy against bytes on the wire
        row["mb_sent_mean"] = statistics.fmean(e["bytes_sent"] for e in group) / 1e6
    if group and all("consensus" in e for e in group):  # the batched engine sees every model: how far apart they are
        row["consensus_distance"] = group[0]["consensus"]
    for prefix in ("val", "shard"):  # a validation split (validation: SHARE); train_evaluate
        if group and all(f"{prefix}_acc" in e for e in group):
            row[f"{prefix}_acc_mean"], row[f"{prefix}_acc_std"] = _mean_std([e[f"{prefix}_acc"] for e in group])
            row[f"{prefix}_loss_mean"] = _mean_std([e[f"{prefix}_loss"] for e in group])[0]
    if bad is not None:
        row["attackers_acc_mean"] = _mean_std([e["test_acc"] for e in bad])[0]
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


def final_summary(logs: dict[int, list[dict]], robust: bool = True, records: Records | None = None) -> dict[str, Any]:
    """Final metrics (mean over the honest evaluating nodes; bad nodes' apart), traffic and
    timeouts, the peers the honest nodes suspect, and per-node rows. Under a rule that is not
    ``robust`` (the mean), one bad model spreads to every node, so the peers whose models were
    refused include honest ones: they are listed as ``refused_from``, never as suspects.
    ``records``: ``iteration_records`` of the logs, where the caller has them."""
    attackers = attackers_of(logs)
    nodes = {}
    suspected_by: dict[str, int] = defaultdict(int)
    for rank, events in logs.items():
        final = next((e for e in reversed(events) if e.get("event") == "final"), None)
        start = next((e for e in events if e.get("event") == "start"), {})
        if final is not None:
            nodes[rank] = {"metrics": final["metrics"], "stats": final["stats"], "elapsed": final["elapsed"],
                           "samples": start.get("samples")}
            if final.get("privacy"):
                nodes[rank]["privacy"] = final["privacy"]
            if final.get("central_privacy"):
                nodes[rank]["central_privacy"] = final["central_privacy"]
            if final.get("peers"):
                nodes[rank]["peers"] = final["peers"]
                for peer in final["peers"].get("suspected", []) if rank not in attackers else []:
                    suspected_by[str(peer)] += 1
    evaluated = [n["metrics"] for r, n in nodes.items() if n["metrics"] and r not in attackers]
    modelled = any(e.get("event") == "final" and e.get("clock") == "modelled"
                   for events in logs.values() for e in events)
    ranks = (records or iteration_records(logs)).ranks
    iterations = int(np.isin(ranks, list(nodes)).sum())
    bytes_sent = sum(n["stats"]["bytes_sent"] for n in nodes.values())
    means = {}
    for key in ("accuracy", "loss", "precision", "recall", "f1", *TASK_METRICS):
        if key in TASK_METRICS and not all(key in m for m in evaluated):
            continue  # not this task's metric
        means[key], means[f"{key}_std"] = _mean_std([m[key] for m in evaluated])
    extra: dict[str, Any] = {}
    if attackers:
        bad = [n["metrics"] for r, n in nodes.items() if n["metrics"] and r in attackers]
        extra["attackers"] = {str(r): b for r, b in sorted(attackers.items())}
        extra["attackers_accuracy"] = _mean_std([m["accuracy"] for m in bad])[0]
    if any("privacy" in n for n in nodes.values()):
        extra["privacy"] = privacy_summary([n["privacy"] for n in nodes.values() if "privacy" in n])
    central = [n["central_privacy"] for n in nodes.values() if "central_privacy" in n]
    if central:  # each member's count of cycles: the most
        extra["central_privacy"] = max(central, key=lambda report: report["cycles"])
    if suspected_by:
        extra["suspected" if robust else "refused_from"] = dict(sorted(suspected_by.items(),
                                                                       key=lambda item: int(item[0])))
    return {
        "nodes_finished": len(nodes),
        "nodes_evaluated": len(evaluated),
        "clock": "modelled" if modelled else "wall",
        "final": means,
        **extra,
        "bytes_sent": bytes_sent,
        "bytes_per_iteration": bytes_sent / iterations if iterations else float("nan"),  # per node
        "bytes_received": sum(n["stats"]["bytes_received"] for n in nodes.values()),
        "timeouts": sum(n["stats"]["gather_timeouts"] for n in nodes.values()),
        "stale_dropped": sum(n["stats"]["stale_dropped"] for n in nodes.values()),
        "malformed_dropped": sum(n["stats"]["malformed_dropped"] for n in nodes.values()),
        "elapsed_max": max((n["elapsed"] for n in nodes.values()), default=float("nan")),
        "per_node": {str(rank): n for rank, n in sorted(nodes.items())},
    }


# The time axis: a node's ``t`` counts from the start of its first iteration, after loading the data
# and model, connecting to its neighbours and starting the algorithm (its start-up), and includes its
# evaluations; the plots show the mean over nodes.
TIME_LABEL = "wall-clock s since training started (start-up not counted)"
MODELLED_TIME_LABEL = "modelled s since training started (the batched engine's cost model)"
MIXED_TIME_LABEL = "s since training started (modelled for batched runs, wall-clock for process runs)"


def privacy_line(privacy: dict[str, Any]) -> str:
    """The summary's line on DP-SGD: the epsilon spent (the most of any node) and the noise."""
    low, high = privacy["noise_multiplier_min"], privacy["noise_multiplier_max"]
    noise = f"{low:.3g}" if math.isclose(low, high) else f"{low:.3g}-{high:.3g}"
    return (f"privacy (DP-SGD)    epsilon {privacy['epsilon']:.3g} at delta {privacy['delta']:g} (the most any node "
            f"spent, {privacy['steps']} steps; noise multiplier {noise}, clipping {privacy['max_grad_norm']:g})")


def time_label(output: Path) -> str:
    """The time axis of a run's plots: modelled for a batched run, wall-clock otherwise."""
    return MODELLED_TIME_LABEL if run_engine(output) == "batched" else TIME_LABEL


def run_config(output: Path) -> dict:
    """A run folder's resolved config.yaml as a dict ({} if there is none, or it is unreadable)."""
    try:
        config = yaml.safe_load((Path(output) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def run_engine(output: Path) -> str:
    """The engine a run folder's config.yaml names (process if it names none)."""
    return str(run_config(output).get("engine", "process"))


def judges_peers(output: Path) -> bool:
    """Whether a run's aggregation rule is robust, so that the peers its nodes refused or found
    deviant point at attackers (under the mean, a bad model spreads and honest peers get refused
    too). A rule this process does not know (a user's) counts as robust."""
    from meshlearn.aggregation import get_rule  # loads torch: not for a report that needs no rule

    try:
        return get_rule(str(run_config(output).get("aggregation", "mean"))).robust
    except ConfigError:
        return True


def run_title(output: Path) -> str:
    """A short name for a run's plots: its folder's name, with the algorithm and node count from
    its config.yaml when that is there (``demo (dpsgd, 6 nodes)``)."""
    output = Path(output)
    name = output.resolve().name or str(output)
    config = run_config(output)
    if not config.get("algorithm") or not config.get("nodes"):
        return name
    return f"{name} ({config['algorithm']}, {config['nodes']} nodes)"


BYTES_LABEL = "MB sent per node"


def x_axes(tables: list[list[dict]], time_axis: str) -> list[tuple[str, str]]:
    """(column, label) of the x axes a figure of these evaluation tables has: iteration, time, and
    the MB sent per node where every row of every table counts it."""
    axes = [("iteration", "iteration"), ("time_mean", time_axis)]
    if all(table and all("mb_sent_mean" in r for r in table) for table in tables):
        axes.append(("mb_sent_mean", BYTES_LABEL))
    return axes


def metric_figure(rows: list[dict], key: str, label: str, title: str, time_axis: str = TIME_LABEL,
                  also: tuple[tuple[str, str], ...] = ()):
    """One metric (``key``: test_acc or test_loss) against iteration, against time (labelled
    ``time_axis``) and against the bytes sent (where counted), mean over nodes ± std, titled
    ``title``; ``also``: more series of the rows to draw beside it, as (key, legend) pairs (the
    training loss beside the test loss). The caller saves and closes the Figure."""
    plt = pyplot()

    axes_keys = x_axes([rows], time_axis)
    series = [(key, "mean over nodes" if not also else f"{label}, mean over nodes")]
    series += [(extra, legend) for extra, legend in also if rows and f"{extra}_mean" in rows[0]]
    fig, axes = plt.subplots(1, len(axes_keys), figsize=(5.5 * len(axes_keys), 4), layout="constrained")
    for ax, (x_key, x_label) in zip(axes, axes_keys):
        xs = [r[x_key] for r in rows]
        for number, (name, legend) in enumerate(series):
            mean = [r[f"{name}_mean"] for r in rows]
            std = [r[f"{name}_std"] for r in rows]
            ax.plot(xs, mean, marker="o", markersize=3, label=legend)
            ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.25,
                            label="± std" if number == 0 else None)  # one legend entry for the bands
        ax.set_xlabel(x_label)
        ax.set_ylabel(label if len(series) == 1 else "loss")
        ax.grid(alpha=0.3)
    # one legend for every panel, below them: inside a panel it hid the curves and the y ticks
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(handles), frameon=False)
    fit_title(fig, f"{title}: {label if len(series) == 1 else 'loss'}")
    return fig


def _plot(rows: list[dict], key: str, label: str, title: str, path: Path, time_axis: str,
          also: tuple[tuple[str, str], ...] = ()) -> None:
    plt = pyplot()

    fig = metric_figure(rows, key, label, title, time_axis, also)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(output: Path, models_module: str | Path | None = None) -> dict[str, Any]:
    """Write summary.csv, summary.json and the figures (accuracy.png, loss.png, topology.png,
    iteration_time.png, predictions.png for image data, perplexity.png for a language model) into a
    run folder. ``models_module``: the file its caller allows the folder's config to import (the
    run's own, for the report at the end of a run); a folder that names another, or one not
    allowed, gets every figure but predictions.png, and nothing of it runs."""
    output = Path(output)
    logs, records = read_run_logs(output)
    rows = evaluation_table(logs, records)
    with (output / "summary.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["iteration"])
        writer.writeheader()
        writer.writerows(rows)
    summary = final_summary(logs, robust=judges_peers(output), records=records)
    summary["iteration_time"] = iteration_times(logs, records)
    summary.update(start_up_times(output, logs))
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    title = run_title(output)
    if rows:
        axis = time_label(output)
        _plot(rows, "test_acc", "test accuracy" if "test_perplexity_mean" not in rows[0] else "next-token accuracy",
              title, output / "accuracy.png", axis)
        if "test_perplexity_mean" in rows[0]:  # a language model's headline metric
            _plot(rows, "test_perplexity", "test perplexity", title, output / PERPLEXITY_FIGURE, axis)
        _plot(rows, "test_loss", "test loss", title, output / "loss.png", axis,
              also=(("train_loss", "training loss since the evaluation before, mean over nodes"),))
    colour = run_config(output).get("topology_colour") or "accuracy"
    _save(topology_figure(output, summary, title, colour), output / TOPOLOGY_FIGURE)
    _save(time_split_figure(logs, title, modelled=summary.get("clock") == "modelled", records=records),
          output / TIME_FIGURE)
    write_run_predictions(output, summary, title, models_module)
    return summary


def write_launched_report(output: Path, launched: float, models_module: str | None = None) -> dict[str, Any]:
    """The launcher's report of the run it just made, started at ``launched`` (``time.time()``): the
    whole command's wall-clock counts its start-up, the training and this report (the figures), so it
    is the time the user waited; ``run.json`` keeps the three instants for a report written later.
    ``models_module``: the run's own (which its user named), as ``write_report`` takes it."""
    output, trained = Path(output), time.time()
    (output / RUN_TIMES).write_text(json.dumps({"launched": launched, "trained": trained, "finished": trained}))
    summary = write_report(output, models_module)
    finished = time.time()
    (output / RUN_TIMES).write_text(json.dumps({"launched": launched, "trained": trained, "finished": finished}))
    summary.update(wall_clock=finished - launched, report=finished - trained)
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def median_node(summary: dict[str, Any]) -> tuple[int, dict[str, Any], int] | None:
    """The honest node whose final accuracy is the median of those that kept their shown predictions
    (the lower one of an even count, the lower rank among equals), its final metrics, and how many
    nodes it is the median of."""
    attackers = set(summary.get("attackers", {}))
    nodes = sorted((node["metrics"]["accuracy"], int(rank), node["metrics"])
                   for rank, node in summary["per_node"].items()
                   if node.get("metrics") and node["metrics"].get("shown") and rank not in attackers)
    if not nodes:
        return None
    _, rank, metrics = nodes[(len(nodes) - 1) // 2]
    return rank, metrics, len(nodes)


def write_run_predictions(output: Path, summary: dict[str, Any], title: str,
                          models_module: str | Path | None = None) -> bool:
    """predictions.png: the test images every final evaluation predicted (``evaluation.shown_samples``),
    labelled by the final model of the node with the median accuracy (``median_node``). False,
    writing nothing, for a dataset that is not images, a run whose nodes kept no predictions, a
    dataset this process cannot load again (a report of a folder copied elsewhere), or a run whose
    config names a models module other than ``models_module`` (``plugins.load_folder_module``)."""
    from meshlearn.config import ExperimentConfig
    from meshlearn.data import split_validation
    from meshlearn.evaluation import PREDICTIONS_FIGURE, write_predictions
    from meshlearn.node import load_run_dataset
    from meshlearn.plugins import load_folder_module

    chosen = median_node(summary)
    if chosen is None:
        return False
    rank, metrics, count = chosen
    try:
        config = ExperimentConfig(**run_config(output))
        load_folder_module(output / "config.yaml", config.models_module, models_module)
        dataset, _ = split_validation(load_run_dataset(config), config.validation, config.seed)
    except (MeshlearnError, ValueError):
        return False
    return write_predictions(output / PREDICTIONS_FIGURE, dataset, metrics["shown"],
                             f"{title}: node {rank}'s final model (the median accuracy of {count} nodes, "
                             f"{metrics['accuracy']:.3f})", config.eval_samples)


TOPOLOGY_FIGURE = "topology.png"
ACCURACY_SPAN = 0.1  # the narrowest accuracy range topology.png's colours span
TIME_FIGURE = "iteration_time.png"
PHASE_COLOURS = {"train": "#3f6fd8", "encode": "#9c27b0", "comm": "#f5a623", "average": "#2e7d32", "eval": "#7a8294"}
LABELLED_NODES = 32  # up to this many nodes the figures name each one
MISSING_COLOUR = "#d0d4db"  # a node without a value (not evaluated, did not finish)
NOTE_WIDTH = 34  # characters a line of a note inside topology.png's circle
# Up to this many nodes topology.png draws every edge; beyond, a summary. At 64 nodes of degree 3 the
# 96 chords across the circle can still be followed; at 128 (192 chords) they already cannot, and
# at 1,024 they are a grey disc. 64 is also where the dashboard and iteration_time.png stop showing
# each node.
DRAWN_GRAPH_NODES = 64
BAR_NODES = 64  # up to this many nodes the time split has a bar per node


def _save(fig, path: Path) -> None:
    if fig is None:
        path.unlink(missing_ok=True)
        return
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


@dataclass(frozen=True)
class NodeColours:
    """What topology.png colours each node by: one value per node (None: none to show), its name,
    the colour scale's range, what a node without a value is called, and the colour map."""

    values: list[float | None]
    label: str
    low: float
    high: float
    missing: str
    cmap: str

    def colour(self, value: float | None):
        """The RGBA colour a node of this ``value`` is drawn in (``MISSING_COLOUR`` for None)."""
        from matplotlib import colormaps
        from matplotlib.colors import Normalize, to_rgba

        if value is None:
            return to_rgba(MISSING_COLOUR)
        return colormaps[self.cmap](Normalize(self.low, self.high)(value))

    @classmethod
    def of(cls, summary: dict[str, Any], n: int, by: str = "accuracy") -> "NodeColours":
        """``by`` ``accuracy``: each node's final test accuracy (the scale ``_accuracy_scale``);
        ``lag``: the seconds each node finished after the first one (the UDP study's look at slow
        nodes: whom a slow node held back). A language model's accuracy is named as what it is,
        its next-token accuracy."""
        per_node = summary.get("per_node", {})
        if by == "lag":
            elapsed = [(per_node.get(str(i)) or {}).get("elapsed") for i in range(n)]
            first = min((e for e in elapsed if e is not None), default=0.0)
            values = [None if e is None else e - first for e in elapsed]
            known = [v for v in values if v is not None]
            return cls(values, "finish-time lag, s after the first node", 0.0, max(known, default=0.0) or 1.0,
                       "did not finish", "plasma")
        metrics = [(per_node.get(str(i)) or {}).get("metrics") or {} for i in range(n)]
        values = [m.get("accuracy") for m in metrics]
        known = [v for v in values if v is not None]
        low, high = _accuracy_scale(known) if known else (0.0, 1.0)
        label = "final next-token accuracy" if any("perplexity" in m for m in metrics) else "final test accuracy"
        return cls(values, label, low, high, "not evaluated", "viridis")


def unused_graph(output: Path) -> str:
    """Why a run's graph means nothing for its algorithm (one line), or "" where its nodes exchange
    with their graph's neighbours. An algorithm this process does not know (a user's, from a models
    module the report does not load) counts as using its graph."""
    from meshlearn.definitions import definition

    name = str(run_config(output).get("algorithm") or "")
    try:
        found = definition(name) if name else None
    except ConfigError:
        return ""
    if found is None or found.uses_graph():
        return ""
    return f"{name} uses no graph ({found.summary})"


def topology_figure(output: Path, summary: dict[str, Any], title: str, colour: str = "accuracy"):
    """The run's graph on a circle, each node coloured by its final test accuracy, or by its
    finish-time lag (``colour``, ``NodeColours``; grey: none; a red ring: a bad node); beyond
    ``DRAWN_GRAPH_NODES`` nodes a summary instead (see ``_topology_summary``). An algorithm that
    uses no graph (leader, local, fedavg: ``unused_graph``) gets its nodes without edges, the
    figure saying why. None without a graph.txt."""
    from meshlearn.topology import read_graph_file

    try:
        graph = read_graph_file(Path(output) / "graph.txt")
    except (OSError, ValueError, MeshlearnError):
        return None
    plt = pyplot()
    from matplotlib.collections import LineCollection

    n = graph.n
    colours = NodeColours.of(summary, n, colour)
    bad = {int(rank) for rank in summary.get("attackers", {}) if int(rank) < n}
    unused = unused_graph(output)
    if n > DRAWN_GRAPH_NODES:
        return _nodes_by_rank(colours, bad, title, unused) if unused else _topology_summary(graph, colours, bad, title)
    fig, ax = plt.subplots(figsize=(6.4, 5.6), layout="constrained")
    xy = _on_circle(n)
    if unused:
        ax.text(0, 0, textwrap.fill(f"{unused}: its nodes are shown without edges", NOTE_WIDTH), ha="center",
                va="center", fontsize=9, color="#4a5160")
    else:
        ax.add_collection(LineCollection([(xy[i], xy[j]) for i, j in graph.edges()], colors="#b8bec9",
                                         linewidths=0.8, zorder=1))
    _circle_of_nodes(fig, ax, xy, colours, bad, 260 if n <= LABELLED_NODES else max(6, 6000 / n))
    if n <= LABELLED_NODES:  # each number dark on a light node, light on a dark one
        for i, (x, y) in enumerate(xy):
            ax.annotate(str(i), (x, y), ha="center", va="center", fontsize=8, zorder=4,
                        color=text_colour_on(colours.colour(colours.values[i])))
    fit_title(fig, f"{title}: {'no graph' if unused else 'topology'}, nodes by {colours.label}")
    return fig


def _nodes_by_rank(colours: NodeColours, bad: set[int], title: str, unused: str):
    """topology.png beyond ``DRAWN_GRAPH_NODES`` nodes for an algorithm that uses no graph: the
    square of cells of ``_grid_of_nodes`` alone (a summary by node degree would describe a graph
    the run did not use), the figure saying why (``unused``)."""
    fig, ax = pyplot().subplots(figsize=(6.4, 6.0), layout="constrained")
    _grid_of_nodes(fig, ax, colours, bad)
    ax.set_title(f"each node by rank, coloured by {colours.label}", fontsize=9)  # no edges to leave out
    ax.set_xlabel(textwrap.fill(unused, 2 * NOTE_WIDTH), fontsize=8)
    fit_title(fig, f"{title}: no graph, {_nodes(len(colours.values))} by {colours.label}")
    return fig


def _on_circle(n: int) -> list[tuple[float, float]]:
    return [(math.cos(2 * math.pi * i / n), math.sin(2 * math.pi * i / n)) for i in range(n)]


def _accuracy_scale(values: list[float]) -> tuple[float, float]:
    """The colour scale of these accuracies: at least ``ACCURACY_SPAN`` wide (0.9555 against 0.9580
    is no contrast to show), ending at the best."""
    return min(min(values), max(values) - ACCURACY_SPAN), max(values)


def _circle_of_nodes(fig, ax, xy: list[tuple[float, float]], colours: NodeColours, bad: set[int],
                     size: float) -> None:
    """Nodes at ``xy`` coloured by ``colours`` (grey: no value), bad ones ringed in red, with a
    colour bar and, where needed, a legend; no axes."""
    n = len(xy)
    values = colours.values
    known = [i for i in range(n) if values[i] is not None]
    unknown = [i for i in range(n) if values[i] is None]
    if unknown:
        ax.scatter([xy[i][0] for i in unknown], [xy[i][1] for i in unknown], s=size, c=MISSING_COLOUR, zorder=2,
                   label=colours.missing)
    if known:
        dots = ax.scatter([xy[i][0] for i in known], [xy[i][1] for i in known], s=size, zorder=2,
                          c=[values[i] for i in known], cmap=colours.cmap, vmin=colours.low, vmax=colours.high)
        fig.colorbar(dots, ax=ax, shrink=0.8, label=colours.label)
    if bad:
        ax.scatter([xy[i][0] for i in bad], [xy[i][1] for i in bad], s=size * 1.6, facecolors="none",
                   edgecolors="#b3261e", linewidths=2 if n <= DRAWN_GRAPH_NODES else 1, zorder=3, label="bad node")
    if bad or unknown:  # below the circle, never over a node
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=2, fontsize=8, frameon=False)
    ax.set_xlim(-1.2, 1.2)
    ax.set_ylim(-1.2, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")


def _grid_of_nodes(fig, ax, colours: NodeColours, bad: set[int]) -> None:
    """One cell per node, row by row in rank order, coloured by ``colours`` (grey: no value; a red
    frame: a bad node), with a colour bar."""
    import numpy as np
    from matplotlib import colormaps

    values = colours.values
    n = len(values)
    columns = math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    cells = np.full(rows * columns, np.nan)
    cells[:n] = [math.nan if v is None else v for v in values]
    known = [v for v in values if v is not None]
    image = ax.imshow(np.ma.masked_invalid(cells.reshape(rows, columns)),
                      cmap=colormaps[colours.cmap].with_extremes(bad=MISSING_COLOUR), vmin=colours.low,
                      vmax=colours.high, interpolation="nearest")
    if rows * columns > n:  # the last row's empty cells
        ax.add_patch(_rectangle((n % columns - 0.5, rows - 1.5), columns - n % columns, 1, facecolor="white"))
    fig.colorbar(image, ax=ax, shrink=0.8, label=colours.label)
    if bad:
        ax.scatter([i % columns for i in bad], [i // columns for i in bad], marker="s", s=max(8, 40000 / n),
                   facecolors="none", edgecolors="#b3261e", linewidths=1.5, label="bad node")
    if bad or len(known) < n:
        from matplotlib.patches import Patch

        handles = [Patch(facecolor=MISSING_COLOUR, label=colours.missing)] if len(known) < n else []
        handles += [Patch(facecolor="none", edgecolor="#b3261e", label="bad node")] if bad else []
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, -0.02), fontsize=8, ncols=2, frameon=False)
    step = max(1, rows // 8)
    ax.set_yticks(range(0, rows, step))
    ax.set_yticklabels([str(r * columns) for r in range(0, rows, step)], fontsize=8)
    ax.set_ylabel(f"first rank of the row ({columns} nodes a row)")
    ax.set_xticks([])
    ax.set_title(f"each node by rank, coloured by {colours.label} (edges not drawn)", fontsize=9)


def _nodes(count: int) -> str:
    return f"{count:,} node" + ("" if count == 1 else "s")


def _rectangle(corner: tuple[float, float], width: float, height: float, **style):
    from matplotlib.patches import Rectangle

    return Rectangle(corner, width, height, linewidth=0, **style)


def _topology_summary(graph, colours: NodeColours, bad: set[int], title: str):
    """topology.png for a graph too big to draw (a circle of hundreds of nodes with their edges is
    a hairball): a square of cells, one per node in rank order, coloured by ``colours`` (a block
    of ranks that fell behind, or the bad nodes, still show), and beside it each node degree's
    values (a box per degree, the bad nodes as red crosses) over how many nodes have it."""
    plt = pyplot()

    n, values = graph.n, colours.values
    degrees = [graph.degree(i) for i in range(n)]
    edges = sum(degrees) // 2
    fig, (grid, by_degree) = plt.subplots(1, 2, figsize=(12, 5.4), gridspec_kw={"width_ratios": [1.1, 1]})
    _grid_of_nodes(fig, grid, colours, bad)
    present = sorted(set(degrees))
    honest = {d: [values[i] for i in range(n) if degrees[i] == d and values[i] is not None and i not in bad]
              for d in present}
    gap = min((b - a for a, b in itertools.pairwise(present)), default=1)
    shown = [d for d in present if honest[d]]
    if shown:
        by_degree.boxplot([honest[d] for d in shown], positions=shown, widths=0.6 * gap, manage_ticks=False,
                          flierprops={"markersize": 3, "markeredgecolor": "#7a8294"},
                          medianprops={"color": "#3f6fd8", "linewidth": 2})
    attackers = [(degrees[i], values[i]) for i in sorted(bad) if values[i] is not None]
    if attackers:
        by_degree.scatter([d for d, _ in attackers], [a for _, a in attackers], marker="x", color="#b3261e",
                          zorder=3, label="bad node")
        by_degree.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)  # beside the boxes
    if any(v is not None for v in values):
        low, high = colours.low, colours.high
        by_degree.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
    ticks = present if len(present) <= 12 else present[::math.ceil(len(present) / 12)]
    by_degree.set_xticks(ticks)
    by_degree.set_xticklabels([f"{d}\n{_nodes(degrees.count(d))}" for d in ticks], fontsize=8)
    by_degree.set_xlim(present[0] - gap, present[-1] + gap)
    by_degree.set_xlabel("node degree (neighbours), and how many nodes have it")
    by_degree.set_ylabel(f"{colours.label} (honest nodes)")
    by_degree.grid(alpha=0.3, axis="y")
    by_degree.set_title(f"{colours.label} by node degree", fontsize=9)
    fit_title(fig, f"{title}: topology summary, {_nodes(n)} and {edges:,} edge{'' if edges == 1 else 's'} "
                   "(too many to draw each edge)")
    fig.tight_layout()
    return fig


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


def time_split_figure(logs: dict[int, list[dict]], title: str, modelled: bool = False,
                      records: Records | None = None):
    """Where an iteration's time goes: each phase's mean (ms), stacked (``PhaseTimes``), per node
    (or, for many nodes, over all of them); None without iterations."""
    times = PhaseTimes.of(logs, records)
    per_node = times.per_node()
    if not per_node:
        return None
    if len(per_node) > BAR_NODES:
        seconds = {f"all {len(per_node)} nodes": times.overall()}
    else:
        seconds = {str(rank): phases for rank, phases in per_node.items()}
    means = {name: {p: 1000 * v for p, v in phases.items()} for name, phases in seconds.items()}
    plt = pyplot()
    names = list(means)
    fig, ax = plt.subplots(figsize=(8, max(2.2, 0.5 + 0.28 * len(names))))
    left = [0.0] * len(names)
    for phase in PHASES:
        widths = [means[name].get(phase, 0.0) for name in names]
        ax.barh(names, widths, left=left, color=PHASE_COLOURS[phase], label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("mean time per iteration (ms" + (", modelled)" if modelled else ")"))
    ax.set_ylabel("node" if len(names) > 1 else "")
    if len(names) > LABELLED_NODES:
        ax.set_yticks([])
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="x")
    fit_title(fig, f"{title}: iteration time split")
    fig.tight_layout()
    return fig


def start_up_times(output: Path, logs: dict[int, list[dict]]) -> dict[str, float]:
    """The whole run's wall-clock time, its start-up (launch until the last node began training) and
    the report's seconds (where the launcher wrote them), from the launcher's run.json; empty where there is none (a `meshlearn node` run)."""
    try:
        times = json.loads((Path(output) / RUN_TIMES).read_text())
        launched, finished = float(times["launched"]), float(times["finished"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    starts = [e["time"] for events in logs.values() for e in events if e.get("event") == "start" and "time" in e]
    times_ = {"wall_clock": finished - launched, "startup": (max(starts) - launched) if starts else float("nan")}
    trained = times.get("trained")
    if isinstance(trained, (int, float)) and launched <= trained <= finished:  # the report's own seconds
        times_["report"] = finished - trained
    return times_


def _report_part(summary: dict[str, Any]) -> str:
    """The summary line's account of the report's own seconds (figures), where they were measured."""
    return f", report {summary['report']:.1f} s" if "report" in summary else ""


def _by_nodes(counts: dict[str, int]) -> str:
    return ", ".join(f"{peer} (by {count} node{'s' if count > 1 else ''})" for peer, count in counts.items())


TASK_METRICS = ("perplexity", "bits_per_token")  # a language model's, beside the loss
PERPLEXITY_FIGURE = "perplexity.png"


def _task_lines(final: dict[str, Any]) -> list[str]:
    """The headline metrics of a run's task: perplexity for a language model, else accuracy and
    macro precision, recall and F1."""
    if "perplexity" in final:
        return [f"test perplexity     {final['perplexity']:.3f} ± {final['perplexity_std']:.3f}",
                f"test loss           {final['loss']:.4f} ({final['bits_per_token']:.3f} bits per token)",
                f"next-token accuracy {final['accuracy']:.4f}"]
    return [f"test accuracy       {final['accuracy']:.4f} ± {final['accuracy_std']:.4f}",
            f"test loss           {final['loss']:.4f}",
            f"macro P / R / F1    {final['precision']:.4f} / {final['recall']:.4f} / {final['f1']:.4f}"]


def format_summary(summary: dict[str, Any]) -> str:
    """A short human-readable table of a run's outcome."""
    final = summary["final"]
    times = summary.get("iteration_time", {})
    lines = [
        f"nodes finished      {summary['nodes_finished']} ({summary['nodes_evaluated']} evaluated"
        + (", honest only" if "attackers" in summary else "") + ")",
        *_task_lines(final),
    ]
    if "attackers" in summary:
        behaviours = ", ".join(f"{rank} {what}" for rank, what in summary["attackers"].items())
        lines.append(f"bad nodes           {behaviours} (their accuracy {summary['attackers_accuracy']:.4f})")
    if "suspected" in summary:
        lines.append("suspected peers     " + _by_nodes(summary["suspected"]))
    if "refused_from" in summary:
        lines.append("models refused from " + _by_nodes(summary["refused_from"]) + " (under a rule that is not robust "
                     "one bad model spreads to every node, so honest nodes are among these: a robust --aggregation "
                     "names the attacker)")
    modelled = summary.get("clock") == "modelled"
    if "total" in times:
        split = "  ".join(f"{p} {times[p]['median'] * 1000:.1f}" for p in PHASES if p in times and p != "eval")
        lines.append(f"iteration (median)  {times['total']['median'] * 1000:.1f} ms  [{split} ms]"
                     + (f"; an evaluation {times['eval']['median'] * 1000:.1f} ms" if "eval" in times else "")
                     + ("  (modelled)" if modelled else ""))
    per_iteration = summary.get("bytes_per_iteration", math.nan) / 1e3
    lines += [
        f"traffic             {summary['bytes_sent'] / 1e6:.1f} MB sent ({per_iteration:.1f} kB per node per "
        f"iteration), {summary['bytes_received'] / 1e6:.1f} MB received",
        f"timeouts / stale    {summary['timeouts']} / {summary['stale_dropped']}",
    ]
    if "privacy" in summary:
        lines.append(privacy_line(summary["privacy"]))
    if "central_privacy" in summary:
        central = summary["central_privacy"]
        lines.append(f"central DP          epsilon {central['epsilon']:.3g} at delta {central['delta']:g} per member "
                     f"({central['cycles']} noised aggregates; noise multiplier {central['noise_multiplier']:g}, "
                     f"clipping {central['clip']:g}, fraction {central['fraction']:g})")
    if modelled:
        lines.append(f"modelled time       {summary['elapsed_max']:.3g} s (the batched engine's cost model)")
        if "wall_clock" in summary:
            lines.append(f"wall-clock          {summary['wall_clock']:.1f} s (start-up {summary['startup']:.1f} s"
                         f"{_report_part(summary)})")
    elif "wall_clock" in summary:
        lines.append(f"wall-clock          {summary['wall_clock']:.1f} s (start-up {summary['startup']:.1f} s, "
                     f"training {summary['elapsed_max']:.1f} s{_report_part(summary)})")
    else:
        lines.append(f"training time       {summary['elapsed_max']:.1f} s (start-up not counted)")
    return "\n".join(lines)
