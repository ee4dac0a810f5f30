"""Experiment files: a list of runs sharing base settings, run one after another, compared in one report.

File layout (YAML)::

    name: tcp-vs-udp
    description: one line
    base: {nodes: 16, dataset: ..., ...}     # the full scale
    quick: {nodes: 6, dataset: digits, ...}  # overrides applied with --quick
    runs:
      - {name: tcp, transport: tcp}
      - {name: udp-sync, transport: udp, udp_mode: sync, quick: {iterations: 20}}

A run's own ``quick`` map applies on top with ``--quick`` only. A ``batched`` map (default:
``{engine: batched}``) applies with ``--batched``: the same runs on the batched engine, at the
scale chosen, times modelled; a run's own ``batched`` map applies on top, and ``batched: false``
leaves a run out of that variant (one the batched engine cannot model yet). A run with ``seeds: [1, 2, 3]``
(in the run or its ``quick`` map) is repeated once per seed as ``NAME-s1``, ...; the report adds
the mean over its seeds (one seed's accuracy is noisy at small scale).

Each run is a normal simulation in ``OUTPUT/<run name>/``; the comparison (plots, tables) goes
to ``OUTPUT/`` itself.
"""

from __future__ import annotations

import contextlib
import csv
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from meshlearn.config import ExperimentConfig, make_config
from meshlearn.data.specs import parse_spec
from meshlearn.errors import ConfigError, DatasetError
from meshlearn.plots import pyplot
from meshlearn.plugins import load_user_module
from meshlearn.sim.figures import (
    MIXED_TIME_LABEL,
    MODELLED_TIME_LABEL,
    TIME_LABEL,
    x_axes,
)
from meshlearn.sim.resume import resumable
from meshlearn.sim.run import simulate
from meshlearn.sim.runfolder import run_config
from meshlearn.sim.summary import final_summary
from meshlearn.sim.tables import evaluation_table, load_logs, read_run_logs

RUN_KEYS = {"name", "quick", "seeds", "batched"}


@dataclass
class Experiment:
    """A parsed experiment file: its name and the resolved configuration of every run."""

    name: str
    description: str
    runs: list[tuple[str, ExperimentConfig]]
    groups: dict[str, list[str]]  # a run with seeds -> the names of its repetitions
    source: str = ""  # the file it was read from
    smaller_scale: bool = False  # the file has a quick scale this experiment does not use


def load_experiment(path: str | Path, quick: bool, output: str | Path | None = None,
                    batched: bool = False, only: list[str] | None = None) -> Experiment:
    """Read and validate an experiment file (every run's config is checked before any starts);
    ``only``: the names of the runs to keep (a run with seeds keeps all its repetitions), in the
    file's order; ConfigError naming the file's runs for a name it does not have."""
    path = Path(path)
    raw = _read_experiment_file(path)
    name = str(raw.get("name", path.stem))
    suffix = ("-quick" if quick else "") + ("-batched" if batched else "")
    out = Path(output) if output else Path("runs") / (name + suffix)
    base = _base_settings(raw, path, quick, batched)
    runs, seen, groups = _run_configs(raw, path, base, quick, batched, out)
    if not runs:
        raise ConfigError(f"experiment file {path}: every run says 'batched: false', so --batched has nothing to run")
    if only:
        runs, groups = _keep_only(only, runs, groups, seen, raw, path)
    return Experiment(name, str(raw.get("description", "")), runs, groups, source=str(path),
                      smaller_scale=not quick and bool(raw.get("quick")))


def _read_experiment_file(path: Path) -> dict[str, Any]:
    """An experiment file's top level, checked: valid YAML, a non-empty ``runs`` list, no unknown
    section."""
    if not path.is_file():
        raise ConfigError(f"experiment file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"experiment file {path} is not valid YAML: fix its syntax") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("runs"), list) or not raw["runs"]:
        raise ConfigError(f"experiment file {path} needs a non-empty 'runs' list")
    unknown = set(raw) - {"name", "description", "base", "quick", "batched", "runs"}
    if unknown:
        raise ConfigError(f"experiment file {path}: unknown section(s) {sorted(unknown)}")
    return raw


def _base_settings(raw: dict[str, Any], path: Path, quick: bool, batched: bool) -> dict[str, Any]:
    """The settings every run starts from: ``base``, then the ``quick`` section (``quick``; a file
    without one anywhere is refused rather than run at full scale) and the ``batched`` one."""
    base = dict(raw.get("base") or {})
    if quick:
        if not raw.get("quick") and not any(isinstance(r, dict) and r.get("quick") for r in raw["runs"]):
            raise ConfigError(f"experiment file {path} has no 'quick' section, so --quick would run it at full "
                              "scale: run it without --quick, or add a 'quick:' map of the settings to shrink")
        base.update(raw.get("quick") or {})
    if batched:
        base.update(raw.get("batched") or {"engine": "batched"})
    return base


def _run_configs(raw: dict[str, Any], path: Path, base: dict[str, Any], quick: bool, batched: bool,
                 out: Path) -> tuple[list[tuple[str, ExperimentConfig]], set[str], dict[str, list[str]]]:
    """Every run's configuration (one per seed of a run with seeds, named ``NAME-sSEED``), the
    names of the file's runs, and each run with seeds' repetitions."""
    runs, seen, groups = [], set(), {}
    for index, run in enumerate(raw["runs"]):
        run_name = _run_name(run, index, path, seen)
        seen.add(run_name)
        settings = _run_settings(run, run_name, path, base, quick, batched)
        if settings is None:
            continue  # this run has no batched variant (yet)
        values, seeds = settings
        repeats = [(f"{run_name}-s{seed}", {"seed": seed}) for seed in seeds] if seeds else [(run_name, {})]
        if seeds:
            groups[run_name] = [n for n, _ in repeats]
        for repeat_name, extra in repeats:
            try:
                runs.append((repeat_name, make_config({**values, **extra, "output": str(out / repeat_name)})))
            except ConfigError as exc:
                raise ConfigError(f"experiment file {path}, run {run_name!r}: {exc}") from None
    return runs, seen, groups


def _run_name(run: Any, index: int, path: Path, seen: set[str]) -> str:
    """Run ``index``'s name: present, not taken by a run before it, without a '/'."""
    if not isinstance(run, dict) or not run.get("name"):
        raise ConfigError(f"experiment file {path}: run {index + 1} needs a name")
    run_name = str(run["name"])
    if run_name in seen or "/" in run_name:
        raise ConfigError(f"experiment file {path}: run name {run_name!r} is repeated or has a '/'")
    return run_name


def _run_settings(run: dict[str, Any], run_name: str, path: Path, base: dict[str, Any], quick: bool,
                  batched: bool) -> tuple[dict[str, Any], list[int] | None] | None:
    """A run's settings over ``base`` (its own ``quick`` and ``batched`` maps applied as the flags
    say) and its seeds; None for a run that says ``batched: false`` under ``batched``."""
    own_quick = run.get("quick") or {}
    if not isinstance(own_quick, dict):
        raise ConfigError(f"experiment file {path}: run {run_name!r}: 'quick' must be a map of settings")
    own_batched = run.get("batched", {}) or {}
    if run.get("batched") is False:
        if batched:
            return None
    elif not isinstance(own_batched, dict):
        raise ConfigError(f"experiment file {path}: run {run_name!r}: 'batched' must be a map of settings or false")
    seeds = own_quick.get("seeds", run.get("seeds")) if quick else run.get("seeds")
    if seeds is not None and (not isinstance(seeds, list) or not seeds or
                              not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)):
        raise ConfigError(f"experiment file {path}: run {run_name!r}: 'seeds' must be a list of integers")
    values = {**base, **{k: v for k, v in run.items() if k not in RUN_KEYS},
              **({k: v for k, v in own_quick.items() if k != "seeds"} if quick else {}),
              **(own_batched if batched else {})}
    return values, seeds


def _keep_only(only: list[str], runs: list[tuple[str, ExperimentConfig]], groups: dict[str, list[str]],
               seen: set[str], raw: dict[str, Any], path: Path
               ) -> tuple[list[tuple[str, ExperimentConfig]], dict[str, list[str]]]:
    """The runs (and groups of repetitions) named in ``only``; ConfigError naming the file's runs
    for a name it does not have."""
    missing = [name for name in only if name not in seen]
    if missing:
        raise ConfigError(f"experiment file {path} has no run {', '.join(map(repr, missing))}: its runs are "
                          f"{', '.join(str(run['name']) for run in raw['runs'])}")
    member_of = {member: name for name, members in groups.items() for member in members}
    runs = [(name, config) for name, config in runs if member_of.get(name, name) in only]
    groups = {name: members for name, members in groups.items() if name in only}
    return runs, groups


def check_datasets(experiment: Experiment) -> None:
    """Every run's dataset exists (before the first run starts); a missing one says where to get it,
    and, for a file with a small scale, that ``--quick`` needs nothing on disk."""
    for name, config in experiment.runs:
        try:
            if config.models_module:  # the user's datasets register themselves
                load_user_module(config.models_module)
            parse_spec(config.dataset)
        except DatasetError as exc:
            quick = "; or run the file's small scale with --quick (nothing to download)" \
                if experiment.smaller_scale else ""
            raise DatasetError(f"experiment file {experiment.source}, run {name!r}: {exc}{quick}") from None


def run_experiment(experiment: Experiment, progress: bool = True, log=print, around_run=None,
                   resume: bool = True) -> Path:
    """Run every run of an experiment in turn, then write the comparison report; returns its folder.
    ``around_run(name, config)``: a context manager each run goes on in (say, a live view of it).
    ``resume`` (the default): a run whose folder holds a finished run of the same configuration is
    kept, not run again, and one stopped half-way goes on from its newest checkpoint; else every
    run starts afresh."""
    check_datasets(experiment)
    for index, (name, config) in enumerate(experiment.runs, start=1):
        if resume and finished_run(config):
            log(f"[{index}/{len(experiment.runs)}] {name}: kept, finished before with this configuration "
                f"({_result_line(Path(config.output))})")
            continue
        iteration = resumable(config, lambda why: log(f"[{index}/{len(experiment.runs)}] {name}: {why}")) \
            if resume else None
        log(f"[{index}/{len(experiment.runs)}] {name}: {config.algorithm} over {config.transport}"
            f"{'/' + config.udp.mode if config.transport == 'udp' else ''}"
            f"{' net ' + config.net.describe() if config.net.active else ''}"
            f"{f', resumed at iteration {_first(iteration)} of {config.iterations}' if iteration is not None else ''}")
        started = time.monotonic()
        with around_run(name, config) if around_run else contextlib.nullcontext():
            result = simulate(config, progress=progress, resume=iteration)
        log(f"[{index}/{len(experiment.runs)}] {name}: {_result_line(result.output)}, "
            f"{time.monotonic() - started:.1f} s")
    output = Path(experiment.runs[0][1].output).parent
    write_comparison(experiment, output)
    return output


def _first(iteration: int | list[int]) -> int:
    """Where a resumed run starts (its slowest node, where each starts from its own)."""
    return min(iteration) if isinstance(iteration, list) else iteration


def finished_run(config: ExperimentConfig) -> bool:
    """Whether ``config.output`` holds a finished run of this configuration: its summary.json written
    after its last log line, and its config.yaml, resolved by this version (settings added since
    take their defaults), the same but for the step time a batched run measured and wrote there."""
    folder = Path(config.output)
    summary, logs = folder / "summary.json", list((folder / "logs").glob("*.jsonl"))
    if not summary.is_file() or not logs or max(f.stat().st_mtime for f in logs) > summary.stat().st_mtime:
        return False
    try:
        saved = yaml.safe_load(make_config(run_config(folder)).to_yaml())
    except ConfigError:
        return False
    fresh = yaml.safe_load(config.model_copy(update={"output": str(folder)}).to_yaml())
    if isinstance(saved.get("batched"), dict) and isinstance(fresh.get("batched"), dict) and \
            not fresh["batched"].get("step_time"):
        fresh["batched"]["step_time"] = saved["batched"].get("step_time")
    return saved == fresh


def _result_line(run_dir: Path) -> str:
    """One run's outcome in a few words (the mean final accuracy of its honest nodes; a language
    model's perplexity)."""
    try:
        final = json.loads((Path(run_dir) / "summary.json").read_text())["final"]
        if final.get("perplexity") is not None:
            return f"perplexity {final['perplexity']:.3f} ± {final['perplexity_std']:.3f}"
        return f"accuracy {final['accuracy']:.4f} ± {final['accuracy_std']:.4f}"
    except (OSError, ValueError, KeyError, TypeError):
        return "no summary written"


def _run_rows(name: str, run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[float]]:
    logs, records = read_run_logs(run_dir)
    final = final_summary(logs, records=records)
    totals = records.seconds.sum(1).tolist()  # each iteration's seconds, its phases added
    per_node = []
    for rank, node in final["per_node"].items():
        stats = node["stats"]
        per_node.append({"run": name, "node": rank, "timeouts": stats.get("gather_timeouts", 0),
                         "chunks_lost": stats.get("chunks_lost", 0),
                         "late_chunks_used": stats.get("late_chunks_used", 0), "bytes_sent": stats.get("bytes_sent", 0),
                         "rcvbuf_drops": stats.get("rcvbuf_drops", 0)})
    iterations = max(1, len(totals))
    row = {
        "run": name,
        "accuracy": final["final"]["accuracy"],
        "f1": final["final"]["f1"],
        **({"perplexity": final["final"]["perplexity"], "loss": final["final"]["loss"]}
           if final["final"].get("perplexity") is not None else {}),  # a language model's
        "iter_mean_ms": statistics.fmean(totals) * 1000 if totals else float("nan"),
        "iter_median_ms": statistics.median(totals) * 1000 if totals else float("nan"),
        "iter_std_ms": statistics.pstdev(totals) * 1000 if totals else float("nan"),
        "timeout_share": sum(p["timeouts"] for p in per_node) / iterations,
        "chunks_lost": sum(p["chunks_lost"] for p in per_node),
        "late_chunks_used": sum(p["late_chunks_used"] for p in per_node),
        "bytes_sent": final["bytes_sent"],
        "bytes_per_iteration": final["bytes_per_iteration"],
        "elapsed_s": final["elapsed_max"],
    }
    return row, per_node, totals


def headline_metric(rows: list[dict[str, Any]]) -> str:
    """What an experiment's tables and figure lead with: ``perplexity`` where every run is a
    language model's (lower is better), else ``accuracy``."""
    return "perplexity" if rows and all("perplexity" in r for r in rows) else "accuracy"


def _seed_means(groups: dict[str, list[str]], rows: list[dict[str, Any]], metric: str = "accuracy"
                ) -> list[dict[str, Any]]:
    by_name = {r["run"]: r for r in rows}
    means = []
    for name, members in groups.items():
        values = [by_name[m][metric] for m in members]
        means.append({"run": name, "seeds": len(members), metric: statistics.fmean(values),
                      f"{metric}_min": min(values), f"{metric}_max": max(values),
                      "iter_mean_ms": statistics.fmean(by_name[m]["iter_mean_ms"] for m in members)})
    return means


def _seed_curves(groups: dict[str, list[str]], curves: list[tuple[str, list[dict[str, Any]]]]
                 ) -> list[tuple[str, list[dict[str, Any]]]]:
    """The curves to draw: a run repeated over seeds as one curve, the mean of its seeds' evaluation
    tables at the iterations they all have (one curve per seed makes a figure nobody can read)."""
    tables = dict(curves)
    member_of = {member: name for name, members in groups.items() for member in members}
    drawn: list[tuple[str, list[dict[str, Any]]]] = []
    for name, table in curves:
        if name not in member_of:
            drawn.append((name, table))
        elif name == groups[member_of[name]][0]:
            members = [{row["iteration"]: row for row in tables[m]} for m in groups[member_of[name]]]
            shared = sorted(set.intersection(*(set(m) for m in members)))
            keys = [k for k in ("time_mean", "test_acc_mean", "test_perplexity_mean", "test_loss_mean", "mb_sent_mean")
                    if all(k in m[i] for m in members
                                                                                      for i in shared)]
            seeds = f"{len(members)} seeds" if len(members) > 1 else "1 seed"
            drawn.append((f"{member_of[name]} (mean of {seeds})",
                          [{"iteration": i, **{k: statistics.fmean(m[i][k] for m in members) for k in keys}}
                           for i in shared]))
    return drawn


LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "x", "+", "*")


def comparison_figure(title: str, curves: list[tuple[str, list[dict[str, Any]]]], time_axis: str = TIME_LABEL):
    """Mean test accuracy of each run (name, evaluation table; where every run is a language
    model's, its perplexity) against iteration, against time (labelled ``time_axis``) and, where
    every run counts them, against the bytes each node sent (accuracy for the traffic; on a log scale
    where runs send orders of magnitude apart); below, where
    every run has it, the mean test loss against the same. Every run gets its own line style and
    (hollow) marker, so identical curves stay visible. The caller saves and closes the matplotlib Figure."""
    plt = pyplot()
    perplexity = all(table and all("test_perplexity_mean" in r for r in table) for _, table in curves)
    metrics = [("test_perplexity_mean", "mean test perplexity") if perplexity else
               ("test_acc_mean", "mean test accuracy")]
    if all(table and all("test_loss_mean" in r for r in table) for _, table in curves):
        metrics.append(("test_loss_mean", "mean test loss"))

    axes_keys = x_axes([table for _, table in curves], time_axis)
    fig, grid = plt.subplots(len(metrics), len(axes_keys), figsize=(6 * len(axes_keys), 4.5 * len(metrics)),
                             squeeze=False)
    for index, (name, table) in enumerate(curves):
        every = max(1, len(table) // 12)  # about 12 hollow markers a curve, staggered between runs
        style = {"linestyle": LINE_STYLES[index % len(LINE_STYLES)], "marker": MARKERS[index % len(MARKERS)],
                 "ms": 5, "mfc": "none", "markevery": (index % every, every), "label": name}
        for axes, (y_key, _) in zip(grid, metrics):
            values = [r[y_key] for r in table]
            for ax, (x_key, _) in zip(axes, axes_keys):
                ax.plot([r[x_key] for r in table], values, **style)
    sent = [r["mb_sent_mean"] for _, table in curves for r in table if r.get("mb_sent_mean", 0) > 0]
    spread = bool(sent) and max(sent) > 100 * min(sent)  # runs that send orders of magnitude apart
    for axes, (_, y_label) in zip(grid, metrics):
        for ax, (x_key, label) in zip(axes, axes_keys):
            ax.set_xlabel(label + (" (log scale)" if x_key == "mb_sent_mean" and spread else ""))
            if x_key == "mb_sent_mean" and spread:
                ax.set_xscale("log")
            ax.set_ylabel(y_label)
            ax.grid(alpha=0.3)
    grid[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")  # one legend, beside the plots
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_comparison(experiment: Experiment, output: Path) -> list[dict[str, Any]]:
    """comparison.png, iteration_times.png, table.csv/.md and per_node.csv for finished runs."""
    plt = pyplot()

    rows, nodes, boxes, curves = [], [], [], []
    for name, config in experiment.runs:
        row, per_node, totals = _run_rows(name, Path(config.output))
        rows.append(row)
        nodes += per_node
        boxes.append((name, [t * 1000 for t in totals]))
        curves.append((name, evaluation_table(load_logs(Path(config.output)))))
    metric = headline_metric(rows)
    with (output / "table.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    with (output / "per_node.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(nodes[0]) if nodes else ["run"])
        writer.writeheader()
        writer.writerows(nodes)
    first = "perplexity | loss | next-token accuracy" if metric == "perplexity" else "accuracy | F1"
    header = (f"| run | {first} | iteration mean / median / std (ms) | timeouts per iteration | chunks lost "
              "(used late) | MB sent | kB per node-iteration |")
    lines = [f"# {experiment.name}", "", experiment.description, "", header, "|---" * header.count(" | ") + "|---|"]
    for r in rows:
        quality = f"{r['perplexity']:.3f} | {r['loss']:.4f} | {r['accuracy']:.4f}" if metric == "perplexity" else \
            f"{r['accuracy']:.4f} | {r['f1']:.4f}"
        lines.append(f"| {r['run']} | {quality} | {r['iter_mean_ms']:.1f} / "
                     f"{r['iter_median_ms']:.1f} / {r['iter_std_ms']:.1f} | {r['timeout_share']:.3f} | "
                     f"{r['chunks_lost']} ({r['late_chunks_used']}) | {r['bytes_sent'] / 1e6:.1f} | "
                     f"{r['bytes_per_iteration'] / 1e3:.1f} |")
    means = _seed_means(experiment.groups, rows, metric)
    if means:
        lines += ["", "Mean over seeds:", "", f"| run | seeds | {metric} mean (min .. max) | iteration mean (ms) |",
                  "|---|---|---|---|"]
        lines += [f"| {m['run']} | {m['seeds']} | {m[metric]:.4f} ({m[metric + '_min']:.4f} .. "
                  f"{m[metric + '_max']:.4f}) | {m['iter_mean_ms']:.1f} |" for m in means]
    (output / "table.md").write_text("\n".join(lines) + "\n")
    (output / "experiment.json").write_text(json.dumps({"name": experiment.name, "runs": rows, "seed_means": means},
                                                       indent=2))

    engines = {config.engine for _, config in experiment.runs}
    axis = MODELLED_TIME_LABEL if engines == {"batched"} else MIXED_TIME_LABEL if "batched" in engines else TIME_LABEL
    fig = comparison_figure(experiment.name, _seed_curves(experiment.groups, curves), axis)
    fig.savefig(output / "comparison.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(boxes)), 4.5))
    ax.boxplot([b for _, b in boxes], showfliers=True, flierprops={"markersize": 3, "alpha": 0.5})
    ax.set_xticks(range(1, len(boxes) + 1), [n for n, _ in boxes], rotation=20)
    ax.set_ylabel("iteration time (ms)")
    ax.set_yscale("log")  # a straggler's iterations and the others' on one readable scale
    ax.set_title(f"{experiment.name}: iteration times per run (box: quartiles; dots: outliers)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(output / "iteration_times.png", dpi=100)
    plt.close(fig)
    return rows
