"""Experiment files: validation, the quick scale, and the comparison report of real runs."""

import csv
import json
import os
from pathlib import Path

import pytest

from meshlearn.errors import ConfigError, DatasetError
from meshlearn.sim.experiment import load_experiment, run_experiment

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_experiment_files_load_at_both_scales(path, tmp_path):
    full = load_experiment(path, quick=False, output=tmp_path)
    quick = load_experiment(path, quick=True, output=tmp_path)
    assert len(full.runs) >= 3
    bases = []  # the file's runs, in order, at each scale (a run with seeds is one run repeated)
    for experiment in (full, quick):
        repeated = {name: base for base, names in experiment.groups.items() for name in names}
        bases.append(list(dict.fromkeys(repeated.get(name, name) for name, _ in experiment.runs)))
        assert all(len(names) >= 2 for names in experiment.groups.values())
    assert bases[0] == bases[1]
    if all(config.model.startswith("gpt") for _, config in full.runs):  # a language model's: embedded text
        assert all(config.dataset == "pystdlib" and config.nodes == 8 for _, config in full.runs)
        assert all(config.dataset == "pystdlib" and config.nodes < 8 for _, config in quick.runs)
        return
    assert all(config.dataset.split(":")[0] in ("cifar10", "fashion-mnist") and config.nodes == 16
               for _, config in full.runs)
    assert all(config.dataset == "digits" for _, config in quick.runs)


def test_run_overrides_and_run_quick_maps(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("name: e\nbase: {nodes: 16, iterations: 100}\nquick: {nodes: 4}\n"
                    "runs:\n  - {name: a, transport: udp}\n  - {name: b, quick: {iterations: 7}}\n")
    full = dict(load_experiment(path, quick=False, output=tmp_path / "out").runs)
    quick = dict(load_experiment(path, quick=True, output=tmp_path / "out").runs)
    assert (full["a"].nodes, full["a"].transport, full["b"].iterations) == (16, "udp", 100)
    assert (quick["a"].nodes, quick["a"].iterations, quick["b"].iterations) == (4, 100, 7)
    assert quick["b"].output == str(tmp_path / "out" / "b")


def test_seeds_repeat_a_run(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("base: {seed: 9}\nruns:\n  - {name: a, seeds: [1, 2]}\n  - {name: b, quick: {seeds: [3]}}\n")
    full = load_experiment(path, quick=False, output=tmp_path / "out")
    quick = load_experiment(path, quick=True, output=tmp_path / "out")
    assert [(n, c.seed) for n, c in full.runs] == [("a-s1", 1), ("a-s2", 2), ("b", 9)]
    assert [(n, c.seed) for n, c in quick.runs] == [("a-s1", 1), ("a-s2", 2), ("b-s3", 3)]
    assert quick.groups == {"a": ["a-s1", "a-s2"], "b": ["b-s3"]}
    assert dict(full.runs)["a-s2"].output == str(tmp_path / "out" / "a-s2")


@pytest.mark.parametrize("text, match", [
    ("name: x\n", "non-empty 'runs'"),
    ("runs: [{transport: tcp}]\n", "needs a name"),
    ("runs: [{name: a}, {name: a}]\n", "repeated"),
    ("runs: [{name: a, nodez: 3}]\n", "run 'a'.*nodez"),
    ("runs: [{name: a}]\nextra: 1\n", "unknown section"),
    ("runs: [{name: a, seeds: 3}]\n", "'seeds' must be a list of integers"),
    ("runs: [{name: a, seeds: [1, x]}]\n", "'seeds' must be a list of integers"),
    ("runs: [{name: a\n", "not valid YAML"),
])
def test_bad_experiment_files(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_experiment(path, quick=False)


def test_missing_experiment_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment(tmp_path / "nope.yaml", quick=False)


def test_report_compares_real_runs(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("name: mini\ndescription: two transports\n"
                    "base: {nodes: 3, topology: ring, iterations: 6, test_after: 3, rounds: 1, seed: 4}\n"
                    "runs:\n  - {name: tcp, transport: tcp, seeds: [4, 5]}\n  - {name: udp, transport: udp, net: 'loss=30%', "
                    "chunk_bytes: 4000, udp_timeout: 0.1}\n")
    said: list[str] = []
    output = run_experiment(load_experiment(path, quick=False, output=tmp_path / "report"), progress=False,
                            log=said.append)
    results = [line for line in said if ": accuracy " in line]  # one result line per run, as it ends
    assert [line.split(":")[0] for line in results] == ["[1/3] tcp-s4", "[2/3] tcp-s5", "[3/3] udp"], said
    for name in ("table.md", "table.csv", "per_node.csv", "experiment.json", "comparison.png", "iteration_times.png"):
        assert (output / name).is_file(), name
    rows = {r["run"]: r for r in csv.DictReader((output / "table.csv").open())}
    assert set(rows) == {"tcp-s4", "tcp-s5", "udp"}
    assert int(rows["tcp-s4"]["chunks_lost"]) == 0 and int(rows["udp"]["chunks_lost"]) > 0
    assert float(rows["udp"]["timeout_share"]) > 0 and 0 < float(rows["tcp-s4"]["accuracy"]) <= 1
    per_node = list(csv.DictReader((output / "per_node.csv").open()))
    assert len(per_node) == 9 and all(int(r["bytes_sent"]) > 0 for r in per_node)
    report = json.loads((output / "experiment.json").read_text())
    assert report["name"] == "mini"
    [mean] = report["seed_means"]
    accuracies = [float(rows[n]["accuracy"]) for n in ("tcp-s4", "tcp-s5")]
    assert mean["run"] == "tcp" and mean["seeds"] == 2
    assert mean["accuracy"] == pytest.approx(sum(accuracies) / 2) and mean["accuracy_min"] == min(accuracies)
    assert "| tcp-s4 |" in (output / "table.md").read_text() and "Mean over seeds" in (output / "table.md").read_text()


def test_comparison_plot_keeps_identical_curves_apart():
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from meshlearn.sim.experiment import comparison_figure
    from meshlearn.sim.figures import TIME_LABEL

    table = [{"iteration": i, "time_mean": 0.1 * i, "test_acc_mean": 0.01 * i} for i in range(1, 31)]
    fig = comparison_figure("mini", [("a", table), ("b", list(table)), ("c", list(table))])
    try:
        assert "mini" in {t.get_text() for t in fig.findobj(Text)}
        assert [ax.get_xlabel() for ax in fig.axes] == ["iteration", TIME_LABEL]
        for ax in fig.axes:
            lines = ax.get_lines()
            assert [line.get_label() for line in lines] == ["a", "b", "c"]
            styles = [(line.get_linestyle(), line.get_marker()) for line in lines]
            assert all(s[0] != t[0] and s[1] != t[1] for i, s in enumerate(styles) for t in styles[i + 1:])
            assert lines[0].get_markevery() != lines[1].get_markevery()  # markers staggered, not stacked
    finally:
        plt.close(fig)


def test_an_experiment_of_language_models_compares_their_perplexity(tmp_path):
    import matplotlib.pyplot as plt

    from meshlearn.sim.experiment import (
        _result_line,
        _seed_means,
        comparison_figure,
        headline_metric,
    )

    table = [{"iteration": i, "time_mean": 0.1 * i, "test_acc_mean": 0.3, "test_perplexity_mean": 50.0 / i}
             for i in range(1, 11)]
    fig = comparison_figure("lm", [("a", table), ("b", table)])
    try:
        assert {ax.get_ylabel() for ax in fig.axes} == {"mean test perplexity"}
        assert list(fig.axes[0].get_lines()[0].get_ydata()) == [50.0 / i for i in range(1, 11)]
    finally:
        plt.close(fig)
    rows = [{"run": "a-s1", "accuracy": 0.3, "perplexity": 12.0, "iter_mean_ms": 1.0},
            {"run": "a-s2", "accuracy": 0.4, "perplexity": 10.0, "iter_mean_ms": 3.0}]
    assert headline_metric(rows) == "perplexity" and headline_metric([{"accuracy": 0.9}]) == "accuracy"
    assert _seed_means({"a": ["a-s1", "a-s2"]}, rows, "perplexity") == [
        {"run": "a", "seeds": 2, "perplexity": 11.0, "perplexity_min": 10.0, "perplexity_max": 12.0,
         "iter_mean_ms": 2.0}]
    (tmp_path / "summary.json").write_text(json.dumps({"final": {"perplexity": 11.5, "perplexity_std": 0.25,
                                                                  "accuracy": 0.3, "accuracy_std": 0.0}}))
    assert _result_line(tmp_path) == "perplexity 11.500 ± 0.250"


def test_comparison_plot_shows_accuracy_against_bytes_where_every_run_counts_them():
    import matplotlib.pyplot as plt

    from meshlearn.sim.experiment import comparison_figure
    from meshlearn.sim.figures import BYTES_LABEL, TIME_LABEL

    counted = [{"iteration": i, "time_mean": 0.1 * i, "test_acc_mean": 0.01 * i, "mb_sent_mean": 0.5 * i}
               for i in range(1, 11)]
    uncounted = [{k: v for k, v in row.items() if k != "mb_sent_mean"} for row in counted]
    fig = comparison_figure("mini", [("full", counted), ("topk", [dict(r, mb_sent_mean=0.05 * r["iteration"])
                                                                  for r in counted])])
    try:
        assert [ax.get_xlabel() for ax in fig.axes] == ["iteration", TIME_LABEL, BYTES_LABEL]
        full, topk = fig.axes[2].get_lines()
        assert list(full.get_xdata()) == pytest.approx([0.5 * i for i in range(1, 11)])
        assert list(topk.get_xdata()) == pytest.approx([0.05 * i for i in range(1, 11)])
        assert list(topk.get_ydata()) == list(full.get_ydata())
    finally:
        plt.close(fig)
    fig = comparison_figure("mini", [("full", counted), ("torchrun", uncounted)])  # not every run counts bytes
    try:
        assert [ax.get_xlabel() for ax in fig.axes] == ["iteration", TIME_LABEL]
    finally:
        plt.close(fig)
    with_loss = [dict(r, test_loss_mean=2.0 / r["iteration"]) for r in counted]
    fig = comparison_figure("mini", [("full", with_loss), ("diloco", with_loss)])  # and the loss below: loss per MB
    try:
        assert [ax.get_ylabel() for ax in fig.axes] == ["mean test accuracy"] * 3 + ["mean test loss"] * 3
        assert fig.axes[5].get_xscale() == "linear"  # 10x apart: a linear scale
        assert list(fig.axes[5].get_lines()[0].get_xdata()) == pytest.approx([0.5 * i for i in range(1, 11)])
        assert list(fig.axes[5].get_lines()[0].get_ydata()) == [2.0 / i for i in range(1, 11)]
    finally:
        plt.close(fig)
    rare = [dict(r, mb_sent_mean=r["mb_sent_mean"] / 1000) for r in with_loss]  # DiLoCo against every step
    fig = comparison_figure("mini", [("full", with_loss), ("diloco", rare)])
    try:
        assert fig.axes[2].get_xscale() == fig.axes[5].get_xscale() == "log" and "log" in fig.axes[2].get_xlabel()
    finally:
        plt.close(fig)


def test_some_runs_of_a_file_and_a_file_stopped_half_way_goes_on_where_it_stopped(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("name: e\nbase: {nodes: 3, dataset: digits, model: mlp, iterations: 2, engine: batched, "
                    "step_time: 0.001}\nruns:\n  - {name: a}\n  - {name: b, lr: 0.2}\n"
                    "  - {name: c, seeds: [1, 2]}\n")
    with pytest.raises(ConfigError, match="has no run 'z': its runs are a, b, c"):
        load_experiment(path, quick=False, output=tmp_path / "out", only=["a", "z"])
    picked = load_experiment(path, quick=False, output=tmp_path / "out", only=["c", "a"])
    assert [name for name, _ in picked.runs] == ["a", "c-s1", "c-s2"] and picked.groups == {"c": ["c-s1", "c-s2"]}
    said: list[str] = []
    run_experiment(load_experiment(path, quick=False, output=tmp_path / "out", only=["a"]), progress=False,
                   log=said.append)
    first = (tmp_path / "out" / "a" / "summary.json").stat().st_mtime_ns
    saved = tmp_path / "out" / "a" / "config.yaml"  # written by a version without a setting added since
    assert "  mix: 0.5\n" in saved.read_text()
    saved.write_text(saved.read_text().replace("  mix: 0.5\n", ""))
    os.utime(saved, ns=(first - 10**9, first - 10**9))
    said.clear()
    output = run_experiment(load_experiment(path, quick=False, output=tmp_path / "out", only=["a", "b"]),
                            progress=False, log=said.append, resume=True)
    assert said[0].startswith("[1/2] a: kept, finished before with this configuration (accuracy ")
    assert (tmp_path / "out" / "a" / "summary.json").stat().st_mtime_ns == first  # not run again
    assert any(line.startswith("[2/2] b: ") and "kept" not in line for line in said)
    assert [row["run"] for row in csv.DictReader((output / "table.csv").open())] == ["a", "b"]  # both reported
    log = next((tmp_path / "out" / "b" / "logs").glob("*.jsonl"))  # a run stopped before its summary: run again
    written = (tmp_path / "out" / "b" / "summary.json").stat().st_mtime_ns  # (a log line after the summary)
    os.utime(log, ns=(written + 10**9,) * 2)
    said.clear()
    run_experiment(load_experiment(path, quick=False, output=tmp_path / "out", only=["b"]), progress=False,
                   log=said.append, resume=True)
    assert "kept" not in said[0]
    path.write_text(path.read_text().replace("{name: a}", "{name: a, lr: 0.3}"))  # another configuration: run again
    said.clear()
    run_experiment(load_experiment(path, quick=False, output=tmp_path / "out", only=["a"]), progress=False,
                   log=said.append, resume=True)
    assert "kept" not in said[0] and (tmp_path / "out" / "a" / "summary.json").stat().st_mtime_ns != first


def test_quick_on_a_file_without_a_quick_section_is_refused_not_run_at_full_scale(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("runs:\n  - {name: a, nodes: 2}\n")
    with pytest.raises(ConfigError, match="no 'quick' section.*without --quick"):
        load_experiment(path, quick=True)
    assert load_experiment(path, quick=False).runs[0][1].nodes == 2
    path.write_text("runs:\n  - {name: a, nodes: 4, quick: {nodes: 2}}\n")  # a run's own quick map counts
    assert load_experiment(path, quick=True).runs[0][1].nodes == 2


def test_a_run_repeated_over_seeds_is_drawn_as_one_curve_the_mean_of_its_seeds():
    from meshlearn.sim.experiment import _seed_curves

    def table(scale, iterations=(10, 20, 30)):
        return [{"iteration": i, "time_mean": scale * i, "test_acc_mean": scale, "mb_sent_mean": 2 * scale * i}
                for i in iterations]

    curves = [("full-s1", table(0.5)), ("full-s2", table(0.7, (10, 20))), ("local", table(0.1)),
              ("topk-s1", table(0.2))]
    drawn = _seed_curves({"full": ["full-s1", "full-s2"], "topk": ["topk-s1"]}, curves)
    assert [name for name, _ in drawn] == ["full (mean of 2 seeds)", "local", "topk (mean of 1 seed)"]
    full = drawn[0][1]
    assert [r["iteration"] for r in full] == [10, 20]  # the iterations every seed reached
    assert full[1] == pytest.approx({"iteration": 20, "time_mean": 12.0, "test_acc_mean": 0.6, "mb_sent_mean": 24.0})
    assert drawn[1][1] == table(0.1)


def test_a_missing_dataset_is_reported_before_the_first_run_with_where_to_get_it_and_quick(tmp_path):
    experiment = load_experiment(EXPERIMENTS / "udp-loss.yaml", quick=False, output=tmp_path / "out")
    missing = tmp_path / "cifar-10-python.tar.gz"
    experiment.runs = [(name, config.model_copy(update={"dataset": f"cifar10:{missing}"}))
                       for name, config in experiment.runs]
    with pytest.raises(DatasetError, match=r"run 'udp-loss-0': dataset path .* does not exist.*"
                                           r"https://www\.cs\.toronto\.edu/~kriz/cifar\.html.*--quick"):
        run_experiment(experiment, progress=False)
    assert not (tmp_path / "out").exists()  # no run started


@pytest.mark.slow  # test_udp holds each model for its time on an emulated link (TCP and UDP) in the default run
def test_the_bandwidth_experiment_at_quick_scale_holds_each_model_for_its_time_on_the_link(tmp_path):
    """experiments/udp-bandwidth.yaml, quick: TCP and UDP at 1, 10 and 100 Mbit/s a link. A digits MLP
    (68,904 bytes) needs 0.55 s on a 1 Mbit/s link and 55 ms on a 10 Mbit/s one: no iteration is faster."""
    output = run_experiment(load_experiment(EXPERIMENTS / "udp-bandwidth.yaml", quick=True, output=tmp_path / "bw"),
                            progress=False, log=lambda line: None)
    rows = {r["run"]: r for r in csv.DictReader((output / "table.csv").open())}
    assert set(rows) == {f"{transport}-{rate}mbit" for transport in ("tcp", "udp") for rate in (1, 10, 100)}
    on_link = {1: 68_904 * 8 / 1e6, 10: 68_904 * 8 / 1e7}
    for transport in ("tcp", "udp"):
        for rate, seconds in on_link.items():
            assert float(rows[f"{transport}-{rate}mbit"]["iter_median_ms"]) >= 1000 * seconds
        median = {rate: float(rows[f"{transport}-{rate}mbit"]["iter_median_ms"]) for rate in (1, 100)}
        assert median[1] > median[100]
    assert int(rows["tcp-1mbit"]["chunks_lost"]) == 0 and float(rows["tcp-1mbit"]["accuracy"]) > 0.2


# slow (25 s, 60 s): quick siblings are test_sharing's runs of every scheme, test_udp's rules for shares
# that come in part, and this file loading at both scales (test_shipped_experiment_files_load_at_both_scales)
@pytest.mark.slow
@pytest.mark.parametrize("batched", [False, True], ids=["process", "batched"])
def test_the_sharing_experiment_at_quick_scale_runs_every_scheme_over_udp_from_the_shares_that_came_in_part(
        tmp_path, batched):
    """experiments/udp-sharing.yaml, quick: each scheme over TCP without loss and over UDP losing a
    fifth of its 1,424-byte datagrams. Over UDP every share comes in part now and then, and the nodes
    average what arrived: no share is refused, and the accuracy stays near the same scheme's over TCP
    (the batched engine runs the whole file; the process engine, whose runs take longer, its UDP runs
    and TCP's top-k, for the bytes a position costs over each)."""
    from meshlearn.sim.tables import load_logs

    schemes = ("full", "topk", "subsample", "quantize", "choco")
    runs = None if batched else [f"udp-{scheme}" for scheme in schemes] + ["tcp-topk"]
    output = run_experiment(load_experiment(EXPERIMENTS / "udp-sharing.yaml", quick=True, output=tmp_path / "sh",
                                            batched=batched, only=runs), progress=False, log=lambda line: None)
    rows = {r["run"]: r for r in csv.DictReader((output / "table.csv").open())}
    assert set(rows) == set(runs or [f"{transport}-{scheme}" for transport in ("tcp", "udp") for scheme in schemes])
    sent = {run: float(row["bytes_per_iteration"]) for run, row in rows.items()}
    for scheme in schemes:
        udp = rows[f"udp-{scheme}"]
        assert int(udp["chunks_lost"]) > 0 and float(udp["accuracy"]) > 0.25, scheme
        if f"tcp-{scheme}" in rows:
            tcp = rows[f"tcp-{scheme}"]
            assert int(tcp["chunks_lost"]) == 0 and float(udp["accuracy"]) > float(tcp["accuracy"]) - 0.1, scheme
        if scheme != "full":
            assert sent[f"udp-{scheme}"] < 0.3 * sent["udp-full"], scheme
    # over UDP top-k sends each position beside its value (8 bytes), over TCP the value and a bitmap (4 + 1.25 at 10%)
    assert sent["udp-topk"] / sent["tcp-topk"] == pytest.approx(8 / 5.25, rel=0.02 if batched else 0.1)
    if not batched:  # the process engine's nodes say what they received in part, and what they refused
        for scheme in schemes[1:]:
            logs = load_logs(output / f"udp-{scheme}")
            events = [e for log in logs.values() for e in log if e["event"] == "iteration"]
            assert sum(e["partial"] for e in events) > 0, scheme
            summary = json.loads((output / f"udp-{scheme}" / "summary.json").read_text())
            assert not any(node["peers"]["peers"] for node in summary["per_node"].values()), scheme
