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


def test_the_report_reads_a_batched_runs_iteration_columns_as_the_per_node_events_give_them(tmp_path):
    """``read_run_logs`` turns the columnar iteration events straight into arrays: the same records as
    ``iteration_records`` of the expanded per-node events, and the same iteration count."""
    import numpy as np

    from meshlearn.config import make_config
    from meshlearn.sim import simulate
    from meshlearn.sim.report import final_summary, iteration_records, load_logs, read_run_logs

    simulate(make_config({"engine": "batched", "nodes": 6, "iterations": 5, "test_after": 2, "dataset": "digits",
                          "topology": "ring", "step_time": 0.001, "output": str(tmp_path)}))
    logs, records = read_run_logs(tmp_path)
    assert not any(e["event"] == "iteration" for events in logs.values() for e in events)
    expanded = iteration_records(load_logs(tmp_path))
    assert len(records[0]) == len(expanded[0]) == 6 * 5
    order, reference = np.lexsort((records[1][:, 0], records[0])), np.lexsort((expanded[1][:, 0], expanded[0]))
    for mine, theirs in zip(records, expanded):
        assert np.array_equal(mine[order], theirs[reference])
    assert not records[2].any()  # the batched engine models no evaluation time in an iteration
    assert final_summary(logs, records=records)["bytes_per_iteration"] == final_summary(load_logs(tmp_path))[
        "bytes_per_iteration"]


def test_a_columnar_iteration_event_gives_each_field_from_its_column_or_shared_and_null_phases_count_zero():
    import numpy as np

    from meshlearn.runlog import columnar_event
    from meshlearn.sim.report import PHASES, iteration_records

    event = columnar_event("iteration", [4, 7], {"train": [1.0, 2.0], "comm": [None, 0.5], "eval": [None, 0.25]},
                           iteration=0, encode=0.125)
    ranks, seconds, evaluated = iteration_records({}, [event])
    assert ranks.tolist() == [4, 7] and evaluated.tolist() == [False, True]
    expected = {"train": [1.0, 2.0], "encode": [0.125, 0.125], "comm": [0.0, 0.5], "average": [0.0, 0.0],
                "eval": [0.0, 0.25]}
    assert np.array_equal(seconds, np.array([expected[phase] for phase in PHASES]).T)
