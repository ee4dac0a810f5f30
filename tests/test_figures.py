"""The figures a run and a network task write can be read: every title and legend lies inside the
figure (a long run name is wrapped, never cut), loss.png's legend sits outside the panels' data,
node numbers contrast with their node's colour, topology.png draws no graph for an algorithm that
uses none, and each figure names what it shows (a language model's next-token accuracy, a task's
confusion matrix)."""

from __future__ import annotations

import random

import pytest

from meshlearn.plots import contrast_ratio, fit_title, pyplot
from meshlearn.sim.figures import metric_figure, time_split_figure
from meshlearn.sim.topologyfigure import (
    DRAWN_GRAPH_NODES,
    GRID_NODES,
    topology_figure,
    unused_graph,
)
from meshlearn.topology.files import write_graph_file
from meshlearn.topology.generators import build_topology

LONG_NAME = "our-dpsgd-with-a-rather-long-results-folder-name (dpsgd, 8 nodes)"
WCAG_TEXT_CONTRAST = 4.5  # WCAG AA's least contrast for normal text


@pytest.fixture
def close_figures():
    yield
    pyplot().close("all")


def _texts_outside(fig) -> list[str]:
    """What of ``fig`` reaches past its edges: its visible texts (titles, labels, legends, notes),
    and anything drawn at all (tick labels included), as the figure's tight box."""
    from matplotlib.text import Text

    fig.canvas.draw()  # lays the figure out as savefig does
    renderer = fig.canvas.get_renderer()
    ticks = {id(label) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for tick in axis.get_major_ticks() + axis.get_minor_ticks() for label in (tick.label1, tick.label2)}
    outside = []
    for text in fig.findobj(Text):
        if id(text) in ticks or not text.get_visible() or not text.get_text().strip():
            continue  # a tick's label is kept even where its tick is not drawn: the tight box has the drawn ones
        if not _inside(text.get_window_extent(renderer), fig.bbox):
            outside.append(text.get_text())
    drawn = fig.get_tightbbox(renderer)  # inches
    if not _inside(drawn, fig.bbox_inches, slack=0.01):
        outside.append(f"the drawn area {drawn.bounds} (inches)")
    return outside


def _inside(box, frame, slack: float = 1.0) -> bool:
    return (box.x0 >= frame.x0 - slack and box.x1 <= frame.x1 + slack and box.y0 >= frame.y0 - slack
            and box.y1 <= frame.y1 + slack)


def _rows(count: int = 5) -> list[dict]:
    """summary.csv rows of a run that learns, with the training loss and the MB sent."""
    rows = []
    for k in range(count):
        loss = 2.0 / (k + 1)
        rows.append({"iteration": 10 * (k + 1), "time_mean": 0.5 * (k + 1), "mb_sent_mean": 2.0 * (k + 1),
                     "test_loss_mean": loss, "test_loss_std": 0.05, "train_loss_mean": loss * 1.1,
                     "train_loss_std": 0.04, "test_acc_mean": 1 - loss / 3, "test_acc_std": 0.02})
    return rows


def _run_folder(folder, nodes: int, algorithm: str = "dpsgd", spec: str = "regular:3", perplexity: bool = False):
    """A run folder with config.yaml and graph.txt, and a summary whose accuracies span 0.5..0.95."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(f"algorithm: {algorithm}\nnodes: {nodes}\n")
    write_graph_file(build_topology(spec, nodes, 1), folder / "graph.txt")
    rng = random.Random(1)
    per_node = {}
    for i in range(nodes):
        metrics = {"accuracy": 0.5 + 0.45 * i / max(1, nodes - 1) + rng.uniform(-0.01, 0.01)}
        if perplexity:
            metrics["perplexity"] = 20.0
        per_node[str(i)] = {"metrics": metrics}
    return {"per_node": per_node}


def test_a_long_title_is_wrapped_to_fit_its_figure_and_a_short_one_is_left_alone(close_figures):
    fig = pyplot().figure(figsize=(4, 3))
    title = fit_title(fig, LONG_NAME + ": topology, nodes by final next-token accuracy")
    assert "\n" in title.get_text() and not _texts_outside(fig)
    whole = LONG_NAME + ": topology, nodes by final next-token accuracy"
    assert "".join(title.get_text().split()) == "".join(whole.split())  # broken at spaces and hyphens: all kept
    assert fit_title(pyplot().figure(figsize=(8, 3)), "short: loss").get_text() == "short: loss"
    assert fit_title(pyplot().figure(figsize=(8, 3)), "a $5 run").get_text() == "a $5 run"  # no mathtext


def test_loss_png_has_one_legend_below_its_panels_outside_every_data_area(close_figures):
    fig = metric_figure(_rows(), "test_loss", "test loss", LONG_NAME,
                        also=(("train_loss", "training loss since the evaluation before, mean over nodes"),))
    assert not _texts_outside(fig)
    assert all(ax.get_legend() is None for ax in fig.axes)  # no legend inside a panel
    (legend,) = fig.legends
    renderer = fig.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), "the legend covers a panel"
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["test loss, mean over nodes", "± std",
                      "training loss since the evaluation before, mean over nodes"]


@pytest.mark.parametrize("nodes", [8, DRAWN_GRAPH_NODES + 36, GRID_NODES + 2])  # circle, grid, distribution
def test_topology_png_fits_its_title_and_legend_in_the_figure(tmp_path, close_figures, nodes):
    summary = _run_folder(tmp_path, nodes)
    summary["per_node"]["3"]["metrics"] = None  # a node not evaluated: a legend entry
    summary["attackers"] = {"5": "sign-flip:10"}
    fig = topology_figure(tmp_path, summary, LONG_NAME)
    assert not _texts_outside(fig)
    assert "\n" in fig._suptitle.get_text()  # wrapped, not cut


def test_node_numbers_contrast_with_their_nodes_colour_dark_on_light_light_on_dark(tmp_path, close_figures):
    from matplotlib.collections import PathCollection

    fig = topology_figure(tmp_path, _run_folder(tmp_path, 12), "contrast")
    (ax, _) = fig.axes
    fig.canvas.draw()
    faces = {}
    for dots in ax.collections:
        if isinstance(dots, PathCollection) and dots.get_array() is not None:
            faces.update({(round(x, 6), round(y, 6)): tuple(c) for (x, y), c in
                          zip(dots.get_offsets(), dots.get_facecolors())})
    numbers = [t for t in ax.texts if t.get_text().isdigit()]
    assert len(numbers) == 12 and len(faces) == 12
    colours = set()
    for text in numbers:
        x, y = text.xy
        face = faces[(round(x, 6), round(y, 6))]
        colours.add(text.get_color())
        assert contrast_ratio(text.get_color(), face) >= WCAG_TEXT_CONTRAST, (text.get_text(), face)
    assert colours == {"black", "white"}  # viridis' yellow end and purple end both occur


@pytest.mark.parametrize("algorithm, uses", [("dpsgd", True), ("gossip", True), ("pushsum", True),
                                             ("leader", False), ("local", False), ("fedavg", False)])
def test_topology_png_draws_the_graph_only_for_an_algorithm_that_uses_one(tmp_path, close_figures, algorithm,
                                                                          uses):
    from matplotlib.collections import LineCollection

    fig = topology_figure(tmp_path, _run_folder(tmp_path, 8, algorithm), f"run ({algorithm}, 8 nodes)")
    edges = sum(len(c.get_segments()) for ax in fig.axes for c in ax.collections if isinstance(c, LineCollection))
    title = fig._suptitle.get_text().replace("\n", " ")
    assert (edges == 12) == uses and (edges == 0) == (not uses), edges
    assert ("no graph" in title) == (not uses) and ("topology" in title) == uses, title
    notes = " ".join(t.get_text() for t in fig.axes[0].texts).replace("\n", " ")
    assert (f"{algorithm} uses no graph" in notes) == (not uses), notes
    assert not _texts_outside(fig)


@pytest.mark.parametrize("nodes", [DRAWN_GRAPH_NODES + 36, GRID_NODES + 2])  # a grid, a distribution
def test_beyond_the_drawn_size_an_algorithm_without_a_graph_gets_no_summary_by_node_degree(tmp_path,
                                                                                           close_figures, nodes):
    fig = topology_figure(tmp_path, _run_folder(tmp_path, nodes, "leader"), "big")
    title = fig._suptitle.get_text().replace("\n", " ")
    assert "no graph" in title and f"{nodes:,} nodes" in title and "degree" not in title
    assert not any("degree" in ax.get_xlabel() for ax in fig.axes)  # the grid and its colour bar only
    assert "leader uses no graph" in fig.axes[0].get_xlabel().replace("\n", " ")
    assert not _texts_outside(fig)


def test_an_algorithm_this_process_does_not_know_counts_as_using_its_graph(tmp_path):
    (tmp_path / "config.yaml").write_text("algorithm: half-step\nnodes: 4\n")  # a user's, from a models module
    assert unused_graph(tmp_path) == ""
    assert unused_graph(tmp_path / "nowhere") == ""


def test_a_language_models_colour_bar_names_its_next_token_accuracy(tmp_path, close_figures):
    fig = topology_figure(tmp_path, _run_folder(tmp_path, 6, perplexity=True), "lm (dpsgd, 6 nodes)")
    assert "final next-token accuracy" in [ax.get_ylabel() for ax in fig.axes]
    assert "nodes by final next-token accuracy" in fig._suptitle.get_text()
    fig = topology_figure(tmp_path, _run_folder(tmp_path, 6), "images (dpsgd, 6 nodes)")
    assert "final test accuracy" in [ax.get_ylabel() for ax in fig.axes]


def test_the_iteration_time_split_fits_a_long_title(close_figures):
    logs = {rank: [{"event": "iteration", "iteration": 0, "train": 0.01, "comm": 0.02}] for rank in range(4)}
    fig = time_split_figure(logs, LONG_NAME)
    assert not _texts_outside(fig)


def test_a_tasks_confusion_png_says_what_it_shows_and_fits(tmp_path, close_figures):
    """A network task's confusion matrix was titled only by its task id."""
    from meshlearn.network.task import results

    metrics = {"confusion": [[50, 3], [2, 45]], "accuracy": 0.95, "class_names": ["cat", "dog"]}
    name = "task 3f2a91c0 (mlp on digits, leader, 2 providers)"
    title = results.confusion_title(name, metrics)
    assert title == f"{name}: confusion matrix of the result model on 100 test samples, accuracy 0.950"
    fig = results.confusion_figure(metrics["confusion"], metrics["class_names"], title)
    assert not _texts_outside(fig)
    assert fig._suptitle.get_text().replace("\n", " ") == title
    cells = [t for t in fig.axes[0].texts]
    image = fig.axes[0].images[0]
    for cell in cells:  # each count readable on its cell's blue
        assert contrast_ratio(cell.get_color(), image.cmap(image.norm(int(cell.get_text())))) >= WCAG_TEXT_CONTRAST
    results.write_results(tmp_path / "t", metrics, b"model", title=name)
    assert (tmp_path / "t" / results.CONFUSION_FILE).stat().st_size > 5_000
