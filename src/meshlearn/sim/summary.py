"""The run summary: summary.json's final metrics, traffic, times and suspects, and the short table
a run prints at its end."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from meshlearn.privacy.budget import privacy_summary
from meshlearn.sim.tables import (
    AVERAGE_FIELDS,
    PHASES,
    Records,
    attackers_of,
    iteration_records,
    mean_std,
)

RUN_TIMES = "run.json"  # written by the launcher: when it started, trained and finished (so wall-clock counts start-up)
TASK_METRICS = ("perplexity", "bits_per_token")  # a language model's, beside the loss


def _node_row(start: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
    """One finished node's row of the summary: its final metrics, traffic counters, training time
    and sample count, and its privacy spent and peer findings where it logged any."""
    row = {"metrics": final["metrics"], "stats": final["stats"], "elapsed": final["elapsed"],
           "samples": start.get("samples")}
    for key in ("privacy", "central_privacy", "peers"):
        if final.get(key):
            row[key] = final[key]
    return row


def _finished_nodes(logs: dict[int, list[dict]]) -> dict[int, dict[str, Any]]:
    """Per node that logged a ``final`` event (its last one), by rank: its row (``_node_row``)."""
    nodes = {}
    for rank, events in logs.items():
        final = next((e for e in reversed(events) if e.get("event") == "final"), None)
        if final is not None:
            start = next((e for e in events if e.get("event") == "start"), {})
            nodes[rank] = _node_row(start, final)
    return nodes


def _suspects(nodes: dict[int, dict[str, Any]], attackers: dict[int, str]) -> dict[str, int]:
    """How many honest nodes suspect each peer, by the peer's rank (as text), in rank order."""
    suspected_by: dict[str, int] = defaultdict(int)
    for rank, node in nodes.items():
        for peer in node.get("peers", {}).get("suspected", []) if rank not in attackers else []:
            suspected_by[str(peer)] += 1
    return dict(sorted(suspected_by.items(), key=lambda item: int(item[0])))


def _final_means(evaluated: list[dict[str, Any]]) -> dict[str, float]:
    """Mean and std over the honest evaluating nodes of each final metric their task has."""
    means = {}
    for key in ("accuracy", "loss", "precision", "recall", "f1", *TASK_METRICS):
        if key in TASK_METRICS and not all(key in m for m in evaluated):
            continue  # not this task's metric
        means[key], means[f"{key}_std"] = mean_std([m[key] for m in evaluated])
    return means


def _findings(nodes: dict[int, dict[str, Any]], attackers: dict[int, str], robust: bool) -> dict[str, Any]:
    """The summary's optional parts: the bad nodes and their accuracy, the privacy spent (DP-SGD's,
    central DP's), and the peers the honest nodes suspect (``refused_from`` under a rule that is
    not ``robust``)."""
    extra: dict[str, Any] = {}
    if attackers:
        bad = [n["metrics"] for r, n in nodes.items() if n["metrics"] and r in attackers]
        extra["attackers"] = {str(r): b for r, b in sorted(attackers.items())}
        extra["attackers_accuracy"] = mean_std([m["accuracy"] for m in bad])[0]
    if any("privacy" in n for n in nodes.values()):
        extra["privacy"] = privacy_summary([n["privacy"] for n in nodes.values() if "privacy" in n])
    central = [n["central_privacy"] for n in nodes.values() if "central_privacy" in n]
    if central:  # each member's count of cycles: the most
        extra["central_privacy"] = max(central, key=lambda report: report["cycles"])
    suspected = _suspects(nodes, attackers)
    if suspected:
        extra["suspected" if robust else "refused_from"] = suspected
    return extra


def _average_model(logs: dict[int, list[dict]]) -> dict[str, float] | None:
    """The honest nodes' average model at the last evaluation (the batched engine's: ``accuracy``,
    ``loss``, a language model's ``perplexity``), or None where the run's log gives none."""
    last = max((e for events in logs.values() for e in events if e.get("event") == "eval" and "average_acc" in e),
               key=lambda e: e.get("iteration", 0), default=None)
    if last is None:
        return None
    return {key: last[name] for name, key in AVERAGE_FIELDS.items() if name in last}


def final_summary(logs: dict[int, list[dict]], robust: bool = True, records: Records | None = None) -> dict[str, Any]:
    """Final metrics (mean over the honest evaluating nodes; bad nodes' apart), traffic and
    timeouts, the peers the honest nodes suspect, and per-node rows. Under a rule that is not
    ``robust`` (the mean), one bad model spreads to every node, so the peers whose models were
    refused include honest ones: they are listed as ``refused_from``, never as suspects.
    ``records``: ``iteration_records`` of the logs, where the caller has them."""
    attackers = attackers_of(logs)
    nodes = _finished_nodes(logs)
    evaluated = [n["metrics"] for r, n in nodes.items() if n["metrics"] and r not in attackers]
    modelled = any(e.get("event") == "final" and e.get("clock") == "modelled"
                   for events in logs.values() for e in events)
    ranks = (records or iteration_records(logs)).ranks
    iterations = int(np.isin(ranks, list(nodes)).sum())
    bytes_sent = sum(n["stats"]["bytes_sent"] for n in nodes.values())
    return {
        "nodes_finished": len(nodes),
        "nodes_evaluated": len(evaluated),
        "clock": "modelled" if modelled else "wall",
        "final": _final_means(evaluated),
        **({"average_model": average} if (average := _average_model(logs)) else {}),
        **_findings(nodes, attackers, robust),
        "bytes_sent": bytes_sent,
        "bytes_per_iteration": bytes_sent / iterations if iterations else float("nan"),  # per node
        "bytes_received": sum(n["stats"]["bytes_received"] for n in nodes.values()),
        "timeouts": sum(n["stats"]["gather_timeouts"] for n in nodes.values()),
        "stale_dropped": sum(n["stats"]["stale_dropped"] for n in nodes.values()),
        "malformed_dropped": sum(n["stats"]["malformed_dropped"] for n in nodes.values()),
        "elapsed_max": max((n["elapsed"] for n in nodes.values()), default=float("nan")),
        "per_node": {str(rank): n for rank, n in sorted(nodes.items())},
    }


def privacy_line(privacy: dict[str, Any]) -> str:
    """The summary's line on DP-SGD: the epsilon spent (the most of any node) and the noise."""
    low, high = privacy["noise_multiplier_min"], privacy["noise_multiplier_max"]
    noise = f"{low:.3g}" if math.isclose(low, high) else f"{low:.3g}-{high:.3g}"
    return (f"privacy (DP-SGD)    epsilon {privacy['epsilon']:.3g} at delta {privacy['delta']:g} (the most any node "
            f"spent, {privacy['steps']} steps; noise multiplier {noise}, clipping {privacy['max_grad_norm']:g})")


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
    average = summary.get("average_model")
    if average:  # the batched engine's
        lines.append("average model       " + (f"perplexity {average['perplexity']:.3f}" if "perplexity" in average
                                               else f"accuracy {average['accuracy']:.4f}")
                     + " (the honest nodes' models averaged)")
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
