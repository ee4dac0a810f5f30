"""The command line: bad input gives one line, the right exit code, and no traceback."""

import socket
import subprocess
import sys

import pytest


def _run(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "meshlearn", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _one_line_error(result, code, *fragments):
    assert result.returncode == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_flag(tmp_path):
    _one_line_error(_run("simulate", "--nodez", "4"), 2, "unrecognized arguments: --nodez")
    _one_line_error(_run("simulate", "--nodes", "four"), 2, "invalid int value")


def test_bad_value(tmp_path):
    _one_line_error(_run("simulate", "--nodes", "1", "--output", str(tmp_path)), 2, "'nodes'", "greater than or equal to 2")
    _one_line_error(_run("simulate", "--lr", "-1", "--output", str(tmp_path)), 2, "'lr'")


def test_missing_dataset_path(tmp_path):
    missing = tmp_path / "nowhere"
    _one_line_error(_run("simulate", "--dataset", f"fashion-mnist:{missing}", "--output", str(tmp_path / "o")), 2,
                    str(missing))


def test_disconnected_graph(tmp_path):
    graph = tmp_path / "graph.txt"
    graph.write_text("4\n0 1\n2 3\n")
    _one_line_error(_run("simulate", "--nodes", "4", "--topology", f"file:{graph}", "--output", str(tmp_path / "o")),
                    2, "disconnected")


def test_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = _run("simulate", "--nodes", "3", "--topology", "ring", "--base-port", str(port),
                      "--output", str(tmp_path / "o"))
    _one_line_error(result, 2, f"port {port}", "in use")


def test_bad_config_file(tmp_path):
    bad = tmp_path / "exp.yaml"
    bad.write_text("nodes: 4\nbatch_sise: 8\n")
    _one_line_error(_run("simulate", "--config", str(bad)), 2, "unknown setting 'batch_sise'")
    bad.write_text("nodes: [4\n")
    _one_line_error(_run("simulate", "--config", str(bad)), 2, "not valid YAML")
    _one_line_error(_run("simulate", "--config", str(tmp_path / "none.yaml")), 2, "does not exist")


def test_simulate_from_yaml_with_flag_override(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("nodes: 3\ntopology: ring\niterations: 4\ntest_after: 2\neval_samples: 50\nrounds: 1\n")
    result = _run("simulate", "--config", str(exp), "--iterations", "6", "--quiet", "--output", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    assert "test accuracy" in result.stdout
    assert "iterations: 6" in (tmp_path / "o" / "config.yaml").read_text()
