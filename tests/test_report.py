"""The report's figures: topology.png (the graph drawn, or beyond 64 nodes a summary) and
iteration_time.png's split (``PhaseTimes``, the rule the dashboard shares)."""

from __future__ import annotations

import random

import pytest

from meshlearn.sim.topologyfigure import topology_figure
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
    from meshlearn.sim.topologyfigure import DRAWN_GRAPH_NODES

    assert DRAWN_GRAPH_NODES == DRAWN
    summary, graph = _run_folder(tmp_path, "regular:3", DRAWN, bad=(1,))
    fig = topology_figure(tmp_path, summary, "small")
    assert _edge_segments(fig) == len(graph.edges()) == 96
    assert "topology, nodes by final test accuracy" in fig._suptitle.get_text()


@pytest.mark.parametrize("nodes", [12, DRAWN + 36])  # the circle, and the summary's grid beyond DRAWN
def test_topology_png_colours_nodes_by_their_finish_time_lag_where_asked(tmp_path, nodes):
    """The UDP study's look at slow nodes: each node's seconds of finishing after the first one."""
    import numpy as np
    from matplotlib.collections import PathCollection

    summary, _ = _run_folder(tmp_path, "regular:3", nodes)
    for i, node in summary["per_node"].items():
        node["elapsed"] = None if int(i) == 5 else 30.0 + (4.0 if int(i) in (2, 3) else 0.1 * (int(i) % 3))
    fig = topology_figure(tmp_path, summary, "slow", colour="lag")
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert "finish-time lag, s after the first node" in labels  # the colour bar's
    expected = [None if int(i) == 5 else node["elapsed"] - 30.0 for i, node in sorted(
        summary["per_node"].items(), key=lambda item: int(item[0]))]
    if nodes <= DRAWN:
        dots = next(c for c in fig.axes[0].collections if isinstance(c, PathCollection) and c.get_array() is not None)
        assert np.allclose(dots.get_array(), [v for v in expected if v is not None])
        assert "nodes by finish-time lag" in fig._suptitle.get_text()
    else:
        cells = fig.axes[0].images[0].get_array()
        assert np.allclose(cells.ravel()[:nodes].filled(np.nan), [np.nan if v is None else v for v in expected],
                           equal_nan=True)
    assert max(v for v in expected if v is not None) == pytest.approx(4.0)


def test_phase_times_are_means_over_iterations_per_node_and_over_everyone():
    from meshlearn.sim.tables import PhaseTimes

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
    from meshlearn.sim.summary import final_summary
    from meshlearn.sim.tables import iteration_records, load_logs, read_run_logs

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
    from meshlearn.sim.tables import PHASES, iteration_records

    event = columnar_event("iteration", [4, 7], {"train": [1.0, 2.0], "comm": [None, 0.5], "eval": [None, 0.25]},
                           iteration=0, encode=0.125)
    records = iteration_records({}, [event])
    ranks, seconds, evaluated = records.ranks, records.seconds, records.evaluated
    assert ranks.tolist() == [4, 7] and evaluated.tolist() == [False, True]
    assert records.iterations.tolist() == [0, 0] and np.isnan(records.train_loss).all()  # none logged
    expected = {"train": [1.0, 2.0], "encode": [0.125, 0.125], "comm": [0.0, 0.5], "average": [0.0, 0.0],
                "eval": [0.0, 0.25]}
    assert np.array_equal(seconds, np.array([expected[phase] for phase in PHASES]).T)


def test_summary_rows_give_the_training_loss_since_the_evaluation_before_and_loss_png_draws_it(tmp_path):
    """The training loss curve (mean and std over nodes) beside the test loss, in summary.csv and loss.png."""
    import csv

    import numpy as np

    from meshlearn.config import make_config
    from meshlearn.sim import simulate
    from meshlearn.sim.figures import metric_figure
    from meshlearn.sim.tables import evaluation_table, load_logs

    simulate(make_config({"engine": "batched", "nodes": 4, "iterations": 5, "test_after": 2, "dataset": "digits",
                          "topology": "ring", "step_time": 0.001, "output": str(tmp_path)}))
    logs = load_logs(tmp_path)
    rows = evaluation_table(logs)
    assert [row["iteration"] for row in rows] == [2, 4, 5]
    for row, (low, high) in zip(rows, [(0, 2), (2, 4), (4, 5)]):  # iterations low+1 .. high, counted from 1
        per_node = [np.mean([e["train_loss"] for e in events if e["event"] == "iteration"
                             and low < e["iteration"] + 1 <= high]) for events in logs.values()]
        assert row["train_loss_mean"] == pytest.approx(np.mean(per_node))
        assert row["train_loss_std"] == pytest.approx(np.std(per_node))
    assert rows[0]["train_loss_mean"] > rows[-1]["train_loss_mean"]  # it learns
    with (tmp_path / "summary.csv").open() as handle:
        written = list(csv.DictReader(handle))
    assert float(written[1]["train_loss_mean"]) == pytest.approx(rows[1]["train_loss_mean"])
    fig = metric_figure(rows, "test_loss", "test loss", "t", also=(("train_loss", "training loss"),))
    assert all(len(ax.get_lines()) == 2 for ax in fig.axes)
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["test loss, mean over nodes", "training loss"]


def _close(fig) -> None:
    from meshlearn.plots import pyplot

    pyplot().close(fig)


def _bars(ax) -> list:
    from matplotlib.patches import Rectangle

    return [p for p in ax.patches if isinstance(p, Rectangle)]


@pytest.mark.parametrize("algorithm", ["dpsgd", "fedavg"])
def test_beyond_the_grid_topology_png_shows_how_many_nodes_have_each_value_at_a_cost_bounded_in_nodes(
        tmp_path, algorithm):
    """A population too large for a cell per node (a FedAvg population of 100,000, most never
    evaluated): the values' distribution, the bad nodes' stacked in red, and how many nodes have no
    value, in as many bars at any size."""
    from matplotlib.colors import to_rgba

    from meshlearn.sim.topologyfigure import DISTRIBUTION_BINS, GRID_NODES

    drawn = {}
    for nodes in (GRID_NODES + 2, 4 * GRID_NODES):  # regular:3 needs an even count
        folder = tmp_path / str(nodes)
        folder.mkdir()
        (folder / "config.yaml").write_text(f"algorithm: {algorithm}\nnodes: {nodes}\n")
        summary, _ = _run_folder(folder, "regular:3", nodes, bad=(3, 700))
        fig = topology_figure(folder, summary, f"big ({algorithm}, {nodes} nodes)")
        panel = fig.axes[0]
        assert not any(ax.images for ax in fig.axes)  # no grid of sub-pixel cells
        heights = [bar.get_height() for bar in _bars(panel)]
        missing = sum(node["metrics"] is None for node in summary["per_node"].values())
        bad_values = sum(summary["per_node"][r]["metrics"] is not None for r in ("3", "700"))
        assert sum(heights[:DISTRIBUTION_BINS]) == nodes - missing - bad_values  # every honest node, once
        assert sum(heights[DISTRIBUTION_BINS:]) == bad_values == 2
        assert all(bar.get_facecolor() == to_rgba("#b3261e") for bar in _bars(panel)[DISTRIBUTION_BINS:])
        legend = [t.get_text() for t in panel.get_legend().get_texts()]
        assert legend == [f"honest nodes: {nodes - missing - 2:,}", "bad nodes: 2", f"not evaluated: {missing:,}"]
        assert f"{nodes:,} nodes, too many to show each" in panel.get_title()
        drawn[nodes] = sum(len(ax.get_children()) for ax in fig.axes)
        _close(fig)
    assert len(set(drawn.values())) == 1, drawn  # as many artists at 4 x the nodes


def test_topology_png_of_an_algorithm_without_a_graph_reads_no_edges(tmp_path, monkeypatch):
    """Its nodes are drawn without edges, so 100,000 nodes' edges are not parsed to draw none."""
    import meshlearn.topology

    def refuse(*_):
        raise AssertionError("the graph file was parsed")

    (tmp_path / "config.yaml").write_text("algorithm: fedavg\nnodes: 100\n")
    summary, _ = _run_folder(tmp_path, "regular:3", 100)
    monkeypatch.setattr(meshlearn.topology, "read_graph_file", refuse)
    fig = topology_figure(tmp_path, summary, "fedavg")
    assert "no graph, 100 nodes" in fig._suptitle.get_text()
    _close(fig)
    (tmp_path / "graph.txt").unlink()  # still: no graph.txt, no figure
    assert topology_figure(tmp_path, summary, "fedavg") is None
    (tmp_path / "config.yaml").write_text("algorithm: dpsgd\nnodes: 100\n")
    write_graph_file(build_topology("regular:3", 100, 1), tmp_path / "graph.txt")
    with pytest.raises(AssertionError, match="parsed"):  # a graph to draw is read
        topology_figure(tmp_path, summary, "dpsgd")


def test_summary_json_keeps_each_node_on_one_line_and_loads_back_as_the_summary():
    import json

    from meshlearn.sim.report import summary_text

    summary = {"nodes_finished": 2, "clock": "modelled", "final": {"accuracy": {"mean": 0.5, "std": 0.0}},
               "per_node": {"0": {"metrics": {"accuracy": 0.5, "shown": [1, 2]}, "elapsed": 1.25},
                            "1": {"metrics": None, "elapsed": None}},
               "attackers": {}, "iteration_time": {"train": {"median": 0.001}}}
    text = summary_text(summary)
    assert json.loads(text) == summary and list(json.loads(text)) == list(summary)
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and '  "nodes_finished": 2,' in lines
    assert '    "0": {"metrics": {"accuracy": 0.5, "shown": [1, 2]}, "elapsed": 1.25},' in lines
    assert '    "1": {"metrics": null, "elapsed": null}' in lines
    assert lines[lines.index('  "per_node": {') + 3] == "  },"  # the two nodes, a line each
    assert json.loads(summary_text({"per_node": {}})) == {"per_node": {}} and summary_text({}) == "{}"
