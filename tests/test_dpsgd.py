"""D-PSGD end to end: real sockets on loopback, real data (digits)."""

import csv
import json

import pytest
import torch
import yaml

from meshlearn.config import make_config
from meshlearn.node import build_node
from meshlearn.runlog import read_jsonl
from meshlearn.sim import simulate
from meshlearn.sim.inprocess import run_threads
from meshlearn.topology import build_topology


def _nodes(config):
    graph = build_topology(config.topology, config.nodes, config.seed)
    return [build_node(config, rank, graph) for rank in range(config.nodes)]


def test_fully_connected_step_gives_every_node_the_plain_mean():
    config = make_config({"nodes": 5, "topology": "full", "rounds": 0, "iterations": 1, "eval_samples": 20,
                          "model": "mlp", "wait_timeout": 30})
    nodes = _nodes(config)
    for node in nodes:  # distinct starting models
        generator = torch.Generator().manual_seed(100 + node.rank)
        node.flat.params.copy_(torch.randn(node.flat.params.shape, generator=generator))
    mean = torch.stack([node.flat.params.clone() for node in nodes]).mean(0)
    run_threads(nodes, timeout=120)
    for node in nodes:
        assert torch.allclose(node.flat.params, mean, atol=1e-6)


def test_consensus_distance_falls_and_buffers_are_averaged():
    config = make_config({"nodes": 6, "topology": "regular:3", "rounds": 1, "iterations": 30, "test_after": 30,
                          "eval_samples": 50, "model": "mlp", "lr": 0.05, "seed": 3})
    nodes = _nodes(config)
    snapshots: dict[int, dict[int, torch.Tensor]] = {}

    def keep(node, iteration, _record):
        snapshots.setdefault(iteration, {})[node.rank] = node.flat.params.clone()

    for node in nodes:
        generator = torch.Generator().manual_seed(7 + node.rank)
        node.flat.params.copy_(torch.randn(node.flat.params.shape, generator=generator) * 0.1)
        node.hooks.append(keep)
    start = torch.stack([node.flat.params.clone() for node in nodes])
    run_threads(nodes, timeout=300)

    def consensus(models: torch.Tensor) -> float:
        return float((models - models.mean(0)).norm(dim=1).mean())

    distances = [consensus(torch.stack([snapshots[i][r] for r in range(6)])) for i in sorted(snapshots)]
    assert consensus(start) > distances[0] > distances[10] > distances[-1]
    assert distances[-1] < 0.05 * consensus(start)


def test_six_nodes_on_digits_reach_90_percent_and_write_every_result_file(tmp_path):
    config = make_config({
        "nodes": 6, "topology": "regular:3", "dataset": "digits", "model": "mlp", "partition": "iid",
        "rounds": 2, "batch_size": 16, "lr": 0.05, "iterations": 120, "test_after": 20, "seed": 11,
        "output": str(tmp_path / "run"),
    })
    result = simulate(config, progress=False)
    out = result.output
    assert yaml.safe_load((out / "config.yaml").read_text())["nodes"] == 6
    lines = (out / "graph.txt").read_text().split("\n")
    assert lines[0] == "6" and len([line for line in lines[1:] if line.strip()]) == 9  # 6 * 3 / 2 edges
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [int(r["iteration"]) for r in rows] == [20, 40, 60, 80, 100, 120]
    assert all(int(r["nodes"]) == 6 for r in rows)
    # accuracy against bytes: what the nodes had sent by each evaluation, counted on their sockets
    sent = [float(r["mb_sent_mean"]) for r in rows]
    assert all(0 < a < b for a, b in zip(sent, sent[1:]))
    assert sent[-1] * 1e6 == pytest.approx(json.loads((out / "summary.json").read_text())["bytes_sent"] / 6)
    for name in ("accuracy.png", "loss.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nodes_finished"] == 6
    assert summary["final"]["accuracy"] >= 0.90
    assert summary["timeouts"] == 0
    for rank in range(6):
        events = list(read_jsonl(out / "logs" / f"node_{rank}.jsonl"))
        assert [e["iteration"] for e in events if e["event"] == "iteration"] == list(range(120))
        final = events[-1]
        assert final["event"] == "final" and final["stats"]["bytes_sent"] > 0
        assert len(final["metrics"]["confusion"]) == 10
        assert 0.9 <= final["metrics"]["f1"] <= 1.0


def test_a_diverged_run_still_writes_its_report(tmp_path):
    config = make_config({"nodes": 2, "topology": "full", "model": "mlp", "lr": 1e6, "iterations": 3, "test_after": 1,
                          "eval_samples": 50, "output": str(tmp_path / "run")})
    result = simulate(config, progress=False)
    summary = json.loads((result.output / "summary.json").read_text())
    assert summary["nodes_finished"] == 2
    rows = list(csv.DictReader((result.output / "summary.csv").open()))
    assert len(rows) == 3 and rows[-1]["test_loss_mean"] in ("nan", "inf")


def test_same_seed_same_partitions_and_graph(tmp_path):
    from meshlearn.sim import prepare_run

    config = make_config({"nodes": 6, "topology": "regular:3", "partition": "shards:2", "output": str(tmp_path / "a")})
    _, first = prepare_run(config)
    _, second = prepare_run(config.model_copy(update={"output": str(tmp_path / "b")}))
    assert (first / "graph.txt").read_text() == (second / "graph.txt").read_text()


def _fake_run(folder, nodes=2, evals=(5, 10)):
    """A run folder with hand-written node logs (no training): what write_report reads."""
    (folder / "logs").mkdir(parents=True)
    for rank in range(nodes):
        events = [{"event": "start", "rank": rank, "samples": 100}]
        events += [{"event": "eval", "iteration": i, "t": 0.1 * i + rank, "test_loss": 1 / i, "test_acc": 0.05 * i}
                    for i in evals]
        events.append({"event": "final", "rank": rank, "elapsed": 2.0, "metrics": None,
                       "stats": {"bytes_sent": 1, "bytes_received": 1, "gather_timeouts": 0, "stale_dropped": 0,
                                 "malformed_dropped": 0}})
        (folder / "logs" / f"node_{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def test_single_run_plots_name_the_run_and_say_what_the_time_axis_leaves_out(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from meshlearn.sim import figures, report, runfolder, tables

    run = _fake_run(tmp_path / "runs" / "demo")
    assert runfolder.run_title(run) == "demo"
    (run / "config.yaml").write_text("nodes: 2\nalgorithm: dpsgd\n")
    assert runfolder.run_title(run) == "demo (dpsgd, 2 nodes)"
    (run / "config.yaml").write_text("nodes: [unclosed\n")
    assert runfolder.run_title(run) == "demo"  # a broken config only loses the details

    rows = tables.evaluation_table(tables.load_logs(run))
    fig = figures.metric_figure(rows, "test_acc", "test accuracy", "demo (dpsgd, 2 nodes)")
    try:
        texts = {t.get_text() for t in fig.findobj(Text)}
        assert "demo (dpsgd, 2 nodes): test accuracy" in texts  # the figure's title
        assert [ax.get_xlabel() for ax in fig.axes] == ["iteration", figures.TIME_LABEL]
        assert "since training started" in figures.TIME_LABEL and "start-up not counted" in figures.TIME_LABEL
        assert list(fig.axes[1].lines[0].get_xdata()) == pytest.approx([1.0, 1.5])  # mean of the nodes' t
    finally:
        plt.close(fig)
    report.write_report(run)
    for name in ("accuracy.png", "loss.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_node_evaluates_once_per_evaluation_point_and_its_last_one_is_its_final_metrics(monkeypatch):
    from meshlearn.node import Node

    config = make_config({"nodes": 2, "topology": "ring", "iterations": 7, "test_after": 3, "dataset": "digits"})
    calls = []
    evaluate = Node.evaluate
    monkeypatch.setattr(Node, "evaluate", lambda node, full=False: calls.append((node.rank, full)) or
                        evaluate(node, full))
    summaries = run_threads(_nodes(config), timeout=120)
    # after iterations 3, 6 and 7 (the last, with every metric): three evaluations, not four
    assert sorted(calls) == [(0, False), (0, False), (0, True), (1, False), (1, False), (1, True)]
    assert all(s["metrics"]["f1"] is not None and "confusion" in s["metrics"] for s in summaries.values())


def test_the_summary_times_an_evaluation_over_the_iterations_that_had_one():
    from meshlearn.sim.summary import format_summary
    from meshlearn.sim.tables import iteration_times

    logs = {0: [{"event": "iteration", "train": 0.002, "comm": 0.001, **({"eval": 0.05} if i % 5 == 4 else {})}
                for i in range(10)]}
    times = iteration_times(logs)
    assert times["eval"]["median"] == pytest.approx(0.05) and times["total"]["median"] == pytest.approx(0.003)
    summary = {"nodes_finished": 1, "nodes_evaluated": 1, "final": {k: 0.5 for k in (
        "accuracy", "accuracy_std", "loss", "precision", "recall", "f1")}, "iteration_time": times,
        "bytes_sent": 0, "bytes_received": 0, "timeouts": 0, "stale_dropped": 0, "elapsed_max": 1.0}
    assert "[train 2.0  encode 0.0  comm 1.0  average 0.0 ms]; an evaluation 50.0 ms" in format_summary(summary)
