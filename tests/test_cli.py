"""The command line: bad input gives one line, the right exit code, and no traceback."""

import socket
import subprocess
import sys

import pytest
from helpers.netproc import free_port


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
    _one_line_error(_run("simulate", "--nodez", "4"), 2, "meshlearn simulate: error: unrecognized arguments: --nodez",
                    "did you mean --nodes?", "see meshlearn simulate --help")
    _one_line_error(_run("simulate", "--nodes", "four"), 2, "invalid int value")
    _one_line_error(_run("simulate", "--topolgy", "ring"), 2, "did you mean --topology?")
    _one_line_error(_run("simulate", "--node", "4"), 2, "unrecognized arguments: --node 4")  # no abbreviations
    _one_line_error(_run("node", "--config", "c.yaml", "--addresses", "a.yaml", "--rank", "0", "--engine", "batched"),
                    2, "meshlearn node: error: unrecognized arguments: --engine batched")


def test_bare_meshlearn_prints_its_help_and_version_is_known():
    bare = _run()
    assert bare.returncode == 0 and "COMMAND" in bare.stdout and "simulate" in bare.stdout, bare.stderr
    version = _run("--version")
    assert version.returncode == 0 and version.stdout.startswith("meshlearn 0."), version.stdout


def test_simulate_help_groups_its_flags():
    out = _run("simulate", "--help").stdout
    titles = [line.split(" (flags")[0] for line in out.splitlines() if line.endswith("(flags override the config file):")]
    assert titles[:7] == ["core", "data and model", "training", "evaluation", "transport and emulated network",
                          "what nodes share, robust aggregation, attacks", "outputs"]
    assert {"UDP transport", "gossip", "leader aggregation", "the batched engine"} <= set(titles)
    assert "other settings" not in titles  # every setting has its group


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


# --- caught before anything starts (issue 15) -----------------------------------------------

SECRET_ENV = {"MESHLEARN_SECRET": "cli-test-secret-0123456789abcdef"}


def _run_env(*args, env_extra=None, timeout=120):
    import os

    return subprocess.run([sys.executable, "-m", "meshlearn", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env_extra or SECRET_ENV)})


@pytest.mark.parametrize("args, fragments", [
    (["--model", "nope"], ["unknown model 'nope'", "--models-module"]),
    (["--seed", str(2**64 + 1)], ["'seed'", "less than or equal to"]),
    (["--peer-timeout", "5000"], ["'peer_timeout'"]),
])
def test_a_request_that_cannot_run_is_refused_before_any_provider_is_claimed(args, fragments):
    # the bootstrap address answers nothing: these errors must come before it is ever asked
    result = _run_env("request", "--bootstrap", f"127.0.0.1:{free_port()}", "--data", "digits", *args)
    _one_line_error(result, 2, *fragments)


def test_request_weights_that_do_not_fit_the_model_are_refused_first(tmp_path, procs):
    import torch
    from helpers.netproc import SECRET, start_network
    from safetensors.torch import save_file

    bootstrap, _ = start_network(procs, 0)  # no provider: a request that got as far as a claim would fail there
    save_file({"x": torch.zeros(3)}, str(tmp_path / "w.safetensors"))
    result = _run_env("request", "--bootstrap", bootstrap, "--data", "digits", "--model", "mlp",
                      "--weights", str(tmp_path / "w.safetensors"), env_extra={"MESHLEARN_SECRET": SECRET})
    _one_line_error(result, 2, "weights file does not fit the model")


def test_a_dead_bootstrap_or_a_taken_dashboard_port_is_said_before_any_work(tmp_path):
    from meshlearn.errors import Unreachable
    from meshlearn.network.identity import KeyPair
    from meshlearn.network.rpc import call

    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(Unreachable, match="connections refused"):  # known from the refusals, not a 60 s timeout
        call(f"{dead}@{KeyPair.generate().text}", "ping", {}, b"some-secret", timeout=60)
    result = _run_env("request", "--bootstrap", f"{dead}@{KeyPair.generate().text}", "--data", "digits")
    _one_line_error(result, 2, f"no bootstrap answers at {dead}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("simulate", "--dashboard", str(port), "--output", str(tmp_path / "run"))
        _one_line_error(result, 2, f"--dashboard {port}: port {port} on 127.0.0.1 is in use")
    assert "starting" not in result.stdout and not (tmp_path / "run" / "logs").exists()  # no node started


def test_a_provider_models_module_with_a_syntax_error_is_one_line(tmp_path):
    (tmp_path / "models.py").write_text("def broken(:\n")
    result = _run_env("provider", "--bootstrap", f"127.0.0.1:{free_port()}", "--models-module",
                      str(tmp_path / "models.py"), timeout=60)
    _one_line_error(result, 2, "failed to load (line 1)", "SyntaxError")


@pytest.mark.parametrize("state, fragment", [("not-a-db.sqlite", "cannot be used"), ("a-file/sub.db", "cannot make")])
def test_a_bootstrap_state_that_is_not_a_registry_is_one_line(tmp_path, state, fragment):
    (tmp_path / "not-a-db.sqlite").write_text("not a database, just text\n" * 50)
    (tmp_path / "a-file").write_text("x")
    result = _run_env("bootstrap", "--state", str(tmp_path / state), "--port", str(free_port()), timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert fragment in result.stderr


def test_simulate_checks_names_before_torch_loads():
    """A wrong model, dataset or topology is reported by the launcher before any heavy import or process."""
    code = ("import sys\n"
            "from meshlearn.config import make_config\n"
            "from meshlearn.errors import MeshlearnError\n"
            "from meshlearn.sim.checks import check_before_start\n"
            "for bad in ({'model': 'nope'}, {'dataset': 'nope'}, {'topology': 'nope'}):\n"
            "    try:\n"
            "        check_before_start(make_config(bad))\n"
            "        sys.exit('not refused: %r' % bad)\n"
            "    except MeshlearnError:\n"
            "        pass\n"
            "sys.exit('torch was imported' if 'torch' in sys.modules else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_zoo_registers_exactly_the_built_in_model_names():
    from meshlearn.models import BUILT_IN, MODELS, build_model
    from meshlearn.models.registry import LANGUAGE_MODELS

    build_model("mlp", (1, 8, 8), 10)  # imports the zoo
    build_model("gpt-tiny", (8,), 256)  # and the language models
    built_in = set(BUILT_IN) | set(LANGUAGE_MODELS)
    assert set(MODELS._items) >= built_in and set(MODELS.names()) == built_in | set(MODELS._items)


@pytest.mark.parametrize("flag, value, fragment", [("--ram", "-5", "'ram_gb'"), ("--cores", "0", "'cores'")])
def test_provider_resources_that_make_no_sense_are_one_line_not_retried_or_replaced(flag, value, fragment):
    result = _run_env("provider", "--bootstrap", f"127.0.0.1:{free_port()}", flag, value, timeout=60)
    _one_line_error(result, 2, fragment)


# --- what a new user trips on (issue 16) ----------------------------------------------------

def _summary_nodes(folder) -> int:
    import csv

    with (folder / "summary.csv").open() as handle:
        return int(list(csv.DictReader(handle))[-1]["nodes"])


def test_a_second_run_into_the_same_folder_starts_clean(tmp_path):
    out = tmp_path / "run"
    for nodes in (3, 2):  # a 2-node run into a 3-node run's folder used to report 3 nodes, mixed
        result = _run("simulate", "--nodes", str(nodes), "--topology", "full", "--iterations", "2",
                      "--test-after", "2", "--output", str(out), "--quiet", timeout=300)
        assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (out / "logs").glob("node_*.jsonl")) == ["node_0.jsonl", "node_1.jsonl"]
    assert "held an earlier run" in result.stderr
    assert _summary_nodes(out) == 2


def test_simulate_says_what_start_up_does_and_counts_it_in_the_wall_clock(tmp_path):
    """The wall-clock counts the command's own start-up, training and report, and nothing before the
    command: a shell that sleeps, then ``exec``s it (the same process, forked before the sleep)."""
    import json
    import shlex
    import time

    command = shlex.join([sys.executable, "-m", "meshlearn", "simulate", "--nodes", "2", "--topology", "full",
                          "--iterations", "2", "--test-after", "2", "--output", str(tmp_path / "run")])
    began = time.monotonic()
    result = subprocess.run(["bash", "-c", f"sleep 3 && exec {command}"], capture_output=True, text=True, timeout=300)
    after_the_sleep = time.monotonic() - began - 3
    assert result.returncode == 0, result.stderr
    said = result.stderr
    for step in ("loading dataset digits", "starting 2 node processes", "nodes started", "2 nodes up in",
                 "connecting to neighbours and training", "iterations"):
        assert step in said, said
    assert said.index("loading dataset") < said.index("starting 2 node") < said.index("nodes up in") \
        < said.rindex("iterations")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # start-up (processes, torch, data) is most of a 2-iteration run, and the wall-clock counts it
    assert summary["wall_clock"] > summary["startup"] > summary["elapsed_max"] > 0
    assert summary["wall_clock"] > summary["report"] > 0
    assert summary["wall_clock"] < after_the_sleep  # the sleep before the command is not counted
    assert f"wall-clock          {summary['wall_clock']:.1f} s (start-up" in result.stdout
    assert f"report {summary['report']:.1f} s)" in result.stdout


def test_a_bootstrap_on_a_busy_port_says_so_first_and_creates_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run_env("bootstrap", "--port", str(port), "--state", str(tmp_path / "new" / "registry.sqlite"),
                          timeout=60)
    _one_line_error(result, 2, f"port {port}", "in use")
    assert "bootstrap on" not in result.stdout
    assert not (tmp_path / "new").exists()


def test_meshlearn_node_uses_its_threads_and_every_rank_shares_one_folder(tmp_path):
    import json

    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0)), b.bind(("127.0.0.1", 0))
        ports = [a.getsockname()[1], b.getsockname()[1]]
    (tmp_path / "pair.yaml").write_text(f"0: 127.0.0.1:{ports[0]}\n1: 127.0.0.1:{ports[1]}\n")
    (tmp_path / "exp.yaml").write_text("nodes: 2\ntopology: full\niterations: 3\ntest_after: 3\nthreads: 1\n")
    procs = [subprocess.Popen([sys.executable, "-m", "meshlearn", "node", "--config", "exp.yaml", "--addresses",
                               "pair.yaml", "--rank", str(rank)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        said = []
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            said.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, err in enumerate(said):  # it says what it does, not only the result at the end
        for step in (f"node {rank} of 2: loading dataset digits", f"node {rank}: listening on",
                     f"connecting to neighbours {1 - rank}", f"node {rank}: connected and training",
                     f"node {rank}: iteration 3/3, train loss", f"node {rank}: finished in"):
            assert step in err, err
    logs = sorted((tmp_path / "runs" / "pair" / "logs").glob("node_*.jsonl"))
    assert [p.name for p in logs] == ["node_0.jsonl", "node_1.jsonl"]
    for path in logs:
        start = json.loads(path.read_text().splitlines()[0])
        assert start["event"] == "start" and start["threads"] == 1


@pytest.mark.parametrize("args, fragment", [
    (["--device", "cuda"], "CUDA is not available"),
    (["--dataset", "mnist"], "mnist needs a folder: mnist:DIR"),
])
def test_a_device_or_dataset_this_machine_lacks_is_one_line(tmp_path, args, fragment):
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    _one_line_error(_run("simulate", *args, "--output", str(tmp_path / "o")), 2, fragment)


def test_a_provider_with_another_secret_is_refused_once_with_one_line(tmp_path):
    """It used to retry registration forever, and its Ctrl-C hung for minutes."""
    import os

    port = free_port()
    bootstrap = subprocess.Popen([sys.executable, "-m", "meshlearn", "bootstrap", "--port", str(port), "--state",
                                  str(tmp_path / "reg.sqlite")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env={**os.environ, **SECRET_ENV})
    try:
        assert "bootstrap on" in bootstrap.stdout.readline()
        for line in bootstrap.stdout:  # serving (and its relay port announcing its key) once it says where
            if "other machines give" in line:
                break
        result = _run_env("provider", "--bootstrap", f"127.0.0.1:{port}", timeout=60,
                          env_extra={"MESHLEARN_SECRET": "another-secret-0123456789abcdef"})
        _one_line_error(result, 2, "cannot use the bootstrap", "different secret", "MESHLEARN_SECRET")
    finally:
        bootstrap.terminate()
        bootstrap.wait(timeout=30)


def test_ctrl_c_stops_a_provider_still_waiting_for_its_bootstrap():
    import os
    import signal

    from meshlearn.network.identity import KeyPair

    # pinned: a provider may start before its bootstrap only if it knows the key to expect
    provider = subprocess.Popen([sys.executable, "-m", "meshlearn", "provider", "--bootstrap",
                                 f"127.0.0.1:{free_port()}@{KeyPair.generate().text}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **SECRET_ENV})
    try:
        for line in provider.stdout:  # it is up and retrying
            if "cannot register" in line:
                break
        provider.send_signal(signal.SIGINT)
        out, _ = provider.communicate(timeout=30)
        assert provider.returncode == 0, out
        assert "stopped before it could register" in out and "registered with" not in out
    finally:
        if provider.poll() is None:
            provider.kill()
            provider.wait()


def _subcommands():
    from meshlearn.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_flag_says_what_it_does_its_choices_and_its_default_once(command):
    import argparse

    problems = []
    for action in _subcommands()[command]._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        flag, text = action.option_strings[-1], action.help or ""
        if len(text.split()) < 3:
            problems.append(f"{flag}: help {text!r} does not say what it does")
        if isinstance(action, argparse._StoreAction) and not action.required and text.count("default") != 1:
            problems.append(f"{flag}: {text!r} should give its default once")
        if action.choices and action.metavar is not None:
            problems.append(f"{flag} hides its choices")
    assert not problems, f"meshlearn {command} --help:\n" + "\n".join(problems)


def test_a_global_flag_after_the_command_says_where_it_goes():
    result = _run("simulate", "-v")
    _one_line_error(result, 2, "-v goes before the command")
