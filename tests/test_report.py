"""The report's figures: topology.png (the graph drawn, or beyond 64 nodes a summary) and
iteration_time.png's split (``PhaseTimes``, the rule the dashboard shares)."""

from __future__ import annotations

import random

import pytest

from meshlearn.sim.report import topology_figure
from meshlearn.topology.files import write_graph_file
from meshlearn.topology.generators import build_topology

DRAWN = 64  # up to this many nodes topology.png draws every edge (report.DRAWN)


def _run_folder(folder, spec: str, nodes: int, bad: tuple[int, ...] = ()) -> dict:
    """A run folder with graph.txt, and a summary whose nodes' accuracies grow with their degree."""
    graph = build_topology(spec, nodes, 1)
    write_graph_file(graph, folder / "graph.txt")
    rng = random.Random(0)
    per_node = {str(i): {"metrics": None if i % 37 == 5 else
                         {"accuracy": min(1.0, 0.7 + 0.01 * graph.degree(i) + rng.gauss(0, 0.01))}}
                for i in range(nodes)}
    return {"per_node": per_node, "attackers": {str(r): "sign-flip:10" for r in bad}}, graph


def _edge_segments(fig) -> int:
    from matplotlib.collections import LineCollection

    return sum(len(c.get_segments()) for ax in fig.axes for c in ax.collections if isinstance(c, LineCollection))


def test_topology_png_of_a_big_graph_is_a_summary_saying_how_many_nodes_and_edges(tmp_path):
    """Issue 33 item 11: at 1,024 nodes every edge on a circle is a hairball; beyond 64 nodes the
    figure draws no edge, and its title says it is a summary of how many nodes and edges."""
    summary, _ = _run_folder(tmp_path, "regular:3", 1024, bad=(3, 700))
    fig = topology_figure(tmp_path, summary, "big (dpsgd, 1024 nodes)")
    title = fig._suptitle.get_text() if fig._suptitle else " ".join(ax.get_title() for ax in fig.axes)
    assert "summary" in title and "1,024 nodes" in title and "1,536 edges" in title, title
    assert _edge_segments(fig) == 0
    fig.savefig(tmp_path / "topology.png", dpi=60)
    assert (tmp_path / "topology.png").stat().st_size > 10_000

    summary, _ = _run_folder(tmp_path, "erdos:0.05", DRAWN + 1)  # degrees that differ
    fig = topology_figure(tmp_path, summary, "random")
    assert "summary" in fig._suptitle.get_text() and _edge_segments(fig) == 0
    fig.savefig(tmp_path / "topology.png", dpi=60)


def test_topology_png_of_a_small_graph_still_draws_every_edge(tmp_path):
    from meshlearn.sim.report import DRAWN_GRAPH_NODES

    assert DRAWN_GRAPH_NODES == DRAWN
    summary, graph = _run_folder(tmp_path, "regular:3", DRAWN, bad=(1,))
    fig = topology_figure(tmp_path, summary, "small")
    assert _edge_segments(fig) == len(graph.edges()) == 96
    assert "topology, nodes by final accuracy" in fig.axes[0].get_title()


def test_phase_times_are_means_over_iterations_per_node_and_over_everyone():
    from meshlearn.sim.report import PhaseTimes

    times = PhaseTimes()
    times.add(0, {"event": "iteration", "train": 0.01, "comm": 0.03})
    times.add(0, {"event": "iteration", "train": 0.03, "comm": None, "eval": 0.02})
    times.add(1, {"event": "iteration", "train": 0.02})
    times.add(1, {"event": "eval", "train": 9.0})  # not an iteration
    per_node = times.per_node()
    assert per_node[0] == pytest.approx({"train": 0.02, "encode": 0.0, "comm": 0.015, "average": 0.0, "eval": 0.01})
    assert per_node[1]["train"] == pytest.approx(0.02) and per_node[1]["comm"] == 0.0
    assert times.overall() == pytest.approx({"train": 0.02, "encode": 0.0, "comm": 0.01, "average": 0.0,
                                             "eval": 0.02 / 3})
    assert PhaseTimes().overall() == {} and PhaseTimes().per_node() == {}
