"""Write a run folder's report: summary.csv, summary.json and the PNG figures, from its per-node
JSONL logs (the tables, the summary and the figures each live in their own module)."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

from meshlearn.errors import MeshlearnError
from meshlearn.plots import pyplot
from meshlearn.sim.figures import (
    PERPLEXITY_FIGURE,
    TIME_FIGURE,
    metric_figure,
    time_label,
    time_split_figure,
)
from meshlearn.sim.runfolder import judges_peers, run_config, run_title
from meshlearn.sim.summary import RUN_TIMES, final_summary, start_up_times
from meshlearn.sim.tables import evaluation_table, iteration_times, read_run_logs
from meshlearn.sim.topologyfigure import TOPOLOGY_FIGURE, topology_figure


def _save(fig, path: Path) -> None:
    """Save ``fig`` at ``path`` and close it; None (no such figure for this run) removes ``path``."""
    if fig is None:
        path.unlink(missing_ok=True)
        return
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


def _plot(rows: list[dict], key: str, label: str, title: str, path: Path, time_axis: str,
          also: tuple[tuple[str, str], ...] = ()) -> None:
    """Save one metric's figure (``metric_figure``) at ``path``."""
    _save(metric_figure(rows, key, label, title, time_axis, also), path)


def summary_text(summary: dict[str, Any]) -> str:
    """summary.json's text: ``json.dumps(summary, indent=2)``'s layout, except that each node of
    ``per_node`` takes one line, written by json's C encoder (indenting, json's pure-Python
    encoder takes a second per 100,000 nodes; one line per node also reads better at that size).
    Loads back to the same dict."""
    parts = []
    for key, value in summary.items():
        if key == "per_node" and isinstance(value, dict) and value:
            nodes = ",\n".join(f"    {json.dumps(str(rank))}: {json.dumps(node)}" for rank, node in value.items())
            text = "{\n" + nodes + "\n  }"
        else:
            text = json.dumps(value, indent=2).replace("\n", "\n  ")
        parts.append(f"  {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}" if parts else "{}"


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
    (output / "summary.json").write_text(summary_text(summary))
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
    (output / "summary.json").write_text(summary_text(summary))
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
        dataset, _ = split_validation(load_run_dataset(config, whole=False), config.validation, config.seed)
    except (MeshlearnError, ValueError):
        return False
    return write_predictions(output / PREDICTIONS_FIGURE, dataset, metrics["shown"],
                             f"{title}: node {rank}'s final model (the median accuracy of {count} nodes, "
                             f"{metrics['accuracy']:.3f})", config.eval_samples)
