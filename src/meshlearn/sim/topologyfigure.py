"""topology.png: the run's graph on a circle, each node coloured by its final accuracy or its
finish-time lag; beyond ``DRAWN_GRAPH_NODES`` nodes a summary (a grid of nodes, beyond
``GRID_NODES`` their values' distribution; values by degree)."""

from __future__ import annotations

import itertools
import math
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshlearn.errors import ConfigError, MeshlearnError
from meshlearn.plots import fit_title, pyplot, text_colour_on
from meshlearn.sim.figures import LABELLED_NODES
from meshlearn.sim.runfolder import run_config

TOPOLOGY_FIGURE = "topology.png"
ACCURACY_SPAN = 0.1  # the narrowest accuracy range topology.png's colours span
MISSING_COLOUR = "#d0d4db"  # a node without a value (not evaluated, did not finish)
NOTE_WIDTH = 34  # characters a line of a note inside topology.png's circle
# Up to this many nodes topology.png draws every edge; beyond, a summary. At 64 nodes of degree 3 the
# 96 chords across the circle can still be followed; at 128 (192 chords) they already cannot, and
# at 1,024 they are a grey disc. 64 is also where the dashboard and iteration_time.png stop showing
# each node.
DRAWN_GRAPH_NODES = 64
# Up to this many nodes (a 64 x 64 grid) the summary shows each node as a cell, still several pixels
# wide; beyond, a cell is a pixel or less (a lone bad node, the few nodes of a population that were
# evaluated, vanish), and the summary shows how many nodes have each value instead.
GRID_NODES = 4096
DISTRIBUTION_BINS = 30  # the bars of that distribution


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
    def of(cls, summary: dict[str, Any], n: int, by: str = "accuracy") -> NodeColours:
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
    unused = unused_graph(output)
    graph = _run_graph(output, unused)
    if graph is None:
        return None
    plt = pyplot()
    from matplotlib.collections import LineCollection

    n = graph.n
    colours = NodeColours.of(summary, n, colour)
    bad = {int(rank) for rank in summary.get("attackers", {}) if int(rank) < n}
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


@dataclass(frozen=True)
class _Nodes:
    """A graph of ``n`` nodes whose edges no figure draws (its algorithm uses none)."""

    n: int


def _run_graph(output: Path, unused: str):
    """The run's graph (graph.txt), None without one. For an algorithm that uses none
    (``unused``), only its node count, as its config.yaml gives it (the graph was built for it):
    reading 100,000 nodes' edges to draw none takes a second."""
    from meshlearn.topology import read_graph_file

    path = Path(output) / "graph.txt"
    if not path.is_file():
        return None
    nodes = run_config(output).get("nodes") if unused else None
    if isinstance(nodes, int) and nodes > 0:
        return _Nodes(nodes)
    try:
        return read_graph_file(path)
    except (OSError, ValueError, MeshlearnError):
        return None


def _nodes_by_rank(colours: NodeColours, bad: set[int], title: str, unused: str):
    """topology.png beyond ``DRAWN_GRAPH_NODES`` nodes for an algorithm that uses no graph: the
    nodes' panel of ``_nodes_panel`` alone (a summary by node degree would describe a graph the run
    did not use), the figure saying why (``unused``)."""
    fig, ax = pyplot().subplots(figsize=(6.4, 6.0), layout="constrained")
    panel = _nodes_panel(fig, ax, colours, bad)
    if panel == "grid":
        ax.set_title(f"each node by rank, coloured by {colours.label}", fontsize=9)  # no edges to leave out
        ax.set_xlabel(textwrap.fill(unused, 2 * NOTE_WIDTH), fontsize=8)
    else:
        ax.set_xlabel(f"{colours.label}\n{textwrap.fill(unused, 2 * NOTE_WIDTH)}", fontsize=8)
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


def _nodes_panel(fig, ax, colours: NodeColours, bad: set[int]) -> str:
    """Each node's value: up to ``GRID_NODES`` nodes the grid of ``_grid_of_nodes``, beyond it (its
    cells too small to see one) their distribution, ``_distribution_of_nodes``. Which it drew."""
    if len(colours.values) <= GRID_NODES:
        _grid_of_nodes(fig, ax, colours, bad)
        return "grid"
    _distribution_of_nodes(ax, colours, bad)
    return "distribution"


def _distribution_of_nodes(ax, colours: NodeColours, bad: set[int]) -> None:
    """How many nodes have each value (``DISTRIBUTION_BINS`` bins over the colour scale, each in its
    colour), the bad nodes' stacked on top in red, and, in the legend, how many nodes have no
    value: what a population too large to show node by node is like, at the cost of its values."""
    import numpy as np
    from matplotlib.patches import Patch

    values = colours.values
    honest = [v for i, v in enumerate(values) if v is not None and i not in bad]
    attackers = [values[i] for i in bad if values[i] is not None]
    edges = np.linspace(colours.low, colours.high, DISTRIBUTION_BINS + 1)
    centres, widths = (edges[:-1] + edges[1:]) / 2, np.diff(edges)
    counts = np.histogram(np.clip(honest, colours.low, colours.high), edges)[0]
    ax.bar(centres, counts, width=widths, color=[colours.colour(c) for c in centres], edgecolor="white",
           linewidth=0.3)
    handles = [Patch(facecolor=colours.colour(colours.high), label=f"honest nodes: {len(honest):,}")]
    if attackers:
        bad_counts = np.histogram(np.clip(attackers, colours.low, colours.high), edges)[0]
        ax.bar(centres, bad_counts, width=widths, bottom=counts, color="#b3261e")
        handles.append(Patch(facecolor="#b3261e", label=f"bad nodes: {len(attackers):,}"))
    missing = len(values) - len(honest) - len(attackers)
    if missing:
        handles.append(Patch(facecolor=MISSING_COLOUR, label=f"{colours.missing}: {missing:,}"))
    ax.legend(handles=handles, loc="upper left", fontsize=8, frameon=False)
    ax.set_xlim(colours.low, colours.high)
    ax.set_ylim(0, 1.25 * max(1, int((counts + (bad_counts if attackers else 0)).max())))  # room for the legend
    ax.set_xlabel(colours.label)
    ax.set_ylabel("nodes")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(f"{_nodes(len(values))}, too many to show each: how many have each {colours.label}",
                 fontsize=9)


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
    of ranks that fell behind, or the bad nodes, still show; beyond ``GRID_NODES`` the values'
    distribution instead, ``_nodes_panel``), and beside it each node degree's values (a box per
    degree, the bad nodes as red crosses) over how many nodes have it."""
    plt = pyplot()

    n, values = graph.n, colours.values
    degrees = [graph.degree(i) for i in range(n)]
    edges = sum(degrees) // 2
    fig, (grid, by_degree) = plt.subplots(1, 2, figsize=(12, 5.4), gridspec_kw={"width_ratios": [1.1, 1]})
    _nodes_panel(fig, grid, colours, bad)
    having = Counter(degrees)  # degree -> how many nodes have it
    present = sorted(having)
    honest: dict[int, list[float]] = {d: [] for d in present}
    for i, d in enumerate(degrees):
        if values[i] is not None and i not in bad:
            honest[d].append(values[i])
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
    by_degree.set_xticklabels([f"{d}\n{_nodes(having[d])}" for d in ticks], fontsize=8)
    by_degree.set_xlim(present[0] - gap, present[-1] + gap)
    by_degree.set_xlabel("node degree (neighbours), and how many nodes have it")
    by_degree.set_ylabel(f"{colours.label} (honest nodes)")
    by_degree.grid(alpha=0.3, axis="y")
    by_degree.set_title(f"{colours.label} by node degree", fontsize=9)
    fit_title(fig, f"{title}: topology summary, {_nodes(n)} and {edges:,} edge{'' if edges == 1 else 's'} "
                   "(too many to draw each edge)")
    fig.tight_layout()
    return fig
