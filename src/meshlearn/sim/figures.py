"""The report's curves: a metric against iteration, time and bytes sent (accuracy.png, loss.png,
perplexity.png), and where an iteration's time goes (iteration_time.png)."""

from __future__ import annotations

from pathlib import Path

from meshlearn.plots import fit_title, pyplot
from meshlearn.sim.runfolder import run_engine
from meshlearn.sim.tables import PHASES, PhaseTimes, Records

# The time axis: a node's ``t`` counts from the start of its first iteration, after loading the data
# and model, connecting to its neighbours and starting the algorithm (its start-up), and includes its
# evaluations; the plots show the mean over nodes.
TIME_LABEL = "wall-clock s since training started (start-up not counted)"
MODELLED_TIME_LABEL = "modelled s since training started (the batched engine's cost model)"
MIXED_TIME_LABEL = "s since training started (modelled for batched runs, wall-clock for process runs)"
BYTES_LABEL = "MB sent per node"  # the third x axis, where the engine counts bytes

TIME_FIGURE = "iteration_time.png"
PERPLEXITY_FIGURE = "perplexity.png"  # a language model's headline curve
PHASE_COLOURS = {"train": "#3f6fd8", "encode": "#9c27b0", "comm": "#f5a623", "average": "#2e7d32", "eval": "#7a8294"}
LABELLED_NODES = 32  # up to this many nodes the figures name each one
BAR_NODES = 64  # up to this many nodes the time split has a bar per node


def time_label(output: Path) -> str:
    """The time axis of a run's plots: modelled for a batched run, wall-clock otherwise."""
    return MODELLED_TIME_LABEL if run_engine(output) == "batched" else TIME_LABEL


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
