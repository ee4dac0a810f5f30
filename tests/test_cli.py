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
    _one_line_error(_run("simulate", "--nodes", "four"), 2, "--nodes four: not a whole number")
    _one_line_error(_run("simulate", "--topolgy", "ring"), 2, "did you mean --topology?")
    _one_line_error(_run("simulate", "--node", "4"), 2, "unrecognized arguments: --node 4")  # no abbreviations
    _one_line_error(_run("node", "--config", "c.yaml", "--addresses", "a.yaml", "--rank", "0", "--engine", "batched"),
                    2, "meshlearn node: error: unrecognized arguments: --engine batched")


def test_bare_meshlearn_prints_its_help_and_version_is_known():
    bare = _run()
    assert bare.returncode == 0 and "COMMAND" in bare.stdout and "simulate" in bare.stdout, bare.stderr
    version = _run("--version")
    assert version.returncode == 0 and version.stdout.startswith("meshlearn 0."), version.stdout


def test_simulate_help_all_groups_its_flags():
    out = _run("simulate", "--help-all").stdout
    titles = [line.split(" (flags")[0] for line in out.splitlines() if line.endswith("(flags override the config file):")]
    assert titles[:7] == ["core", "data and model", "training", "evaluation", "transport and emulated network",
                          "what nodes share, robust aggregation, attacks", "outputs"]
    assert {"UDP transport", "gossip", "leader aggregation", "the batched engine"} <= set(titles)
    assert "other settings" not in titles  # every setting has its group


def test_bad_value(tmp_path):
    _one_line_error(_run("simulate", "--nodes", "1", "--output", str(tmp_path)), 2,
                    "meshlearn simulate: error: --nodes 1: ", "greater than or equal to 2")
    _one_line_error(_run("simulate", "--lr=-1", "--output", str(tmp_path)), 2, "error: --lr -1: ")


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
    (["--seed", str(2**64 + 1)], [f"--seed {2**64 + 1}: ", "less than or equal to"]),
    (["--peer-timeout", "5000"], ["--peer-timeout 5000: "]),
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
    from meshlearn.network.channel.identity import KeyPair
    from meshlearn.network.channel.rpc import call

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


def _in_own_home(tmp_path, *args):
    """``meshlearn ARGS`` with a $MESHLEARN_HOME of its own: no bootstrap known, so an address
    without @KEY takes the first-use path (its key asked of the relay port)."""
    return _run_env(*args, env_extra={**SECRET_ENV, "MESHLEARN_HOME": str(tmp_path / "home")}, timeout=60)


NETWORK_COMMANDS = {"request": ["request", "--data", "digits"], "provider": ["provider"],
                    "results": ["results", "some-task"]}  # every command that takes --bootstrap


@pytest.mark.parametrize("command", sorted(NETWORK_COMMANDS))
def test_a_bootstrap_address_where_nothing_runs_says_so_not_that_a_key_is_missing(tmp_path, command):
    dead = f"127.0.0.1:{free_port()}"  # nothing there, nor at its relay port (+ 1)
    result = _in_own_home(tmp_path, *NETWORK_COMMANDS[command], "--bootstrap", dead)
    _one_line_error(result, 2, f"no bootstrap answers at {dead} (connection refused)", "is it running",
                    "correct --bootstrap")
    assert "@KEY" not in result.stderr and "cannot learn the key" not in result.stderr
    assert not (tmp_path / "home" / "known_bootstraps").exists()


@pytest.mark.parametrize("command", ["request", "provider"])
def test_a_bootstrap_address_that_answers_without_a_relay_asks_for_its_key(tmp_path, command):
    with socket.socket() as something:  # takes connections (the kernel's queue), announces no key
        something.bind(("127.0.0.1", free_port()))  # its port + 1 free: no relay there
        something.listen(8)
        address = f"127.0.0.1:{something.getsockname()[1]}"
        result = _in_own_home(tmp_path, *NETWORK_COMMANDS[command], "--bootstrap", address)
    _one_line_error(result, 2, f"cannot learn the key of the bootstrap at {address} (something answers there",
                    f"give it with --bootstrap {address}@KEY")


class _Listening:
    """A bootstrap's port and its relay's (port + 1) taken by sockets that never accept: a
    connection to either, even one closed at once, stays in its queue for ``contacted`` to see."""

    def __enter__(self):
        self.sockets = []
        port = free_port()
        for offset in (0, 1):
            sock = socket.socket()
            sock.bind(("127.0.0.1", port + offset))
            sock.listen(8)
            sock.setblocking(False)
            self.sockets.append(sock)
        self.address = f"127.0.0.1:{port}"
        return self

    def contacted(self) -> bool:
        for sock in self.sockets:
            try:
                sock.accept()[0].close()
                return True
            except BlockingIOError:
                pass
        return False

    def __exit__(self, *exc) -> None:
        for sock in self.sockets:
            sock.close()


@pytest.mark.parametrize("args, fragments", [
    (["request", "--data", "fashion-mnist:{tmp}/missing"], ["dataset path {tmp}/missing does not exist"]),
    (["request", "--data", "{tmp}/missing"], ["data path {tmp}/missing does not exist"]),
    (["request", "--data", "fashion-mnist:{tmp}"], ["{tmp} has no train-images-idx3-ubyte.gz"]),  # read, not only seen
    (["request", "--data", "digits", "--weights", "{tmp}/w.safetensors"],
     ["weights file {tmp}/w.safetensors does not exist"]),
    (["request", "--data", "digits", "--output", "{tmp}/a-file/out"],
     ["--output {tmp}/a-file/out: {tmp}/a-file is a file, not a folder"]),
    (["request", "--data", "digits", "--models-module", "{tmp}/missing.py"], ["{tmp}/missing.py"]),
    (["provider", "--workdir", "{tmp}/a-file/work"], ["--workdir {tmp}/a-file/work: {tmp}/a-file is a file"]),
    (["provider", "--data-root", "{tmp}/missing"], ["--data-root {tmp}/missing is not a folder"]),
    (["provider", "--models-module", "{tmp}/missing.py"], ["{tmp}/missing.py"]),
    (["results", "some-task", "--output", "{tmp}/a-file"], ["--output {tmp}/a-file: {tmp}/a-file is a file"]),
])
def test_every_local_check_comes_before_the_first_network_step(tmp_path, args, fragments):
    """A bad path or value is said first: its line is about it, not the bootstrap, and neither the
    bootstrap's port nor its relay's was ever connected to (nor its key recorded)."""
    (tmp_path / "a-file").write_text("x")
    with _Listening() as bootstrap:
        result = _in_own_home(tmp_path, *[arg.format(tmp=tmp_path) for arg in args], "--bootstrap", bootstrap.address)
        assert not bootstrap.contacted(), result.stderr
    _one_line_error(result, 2, *[fragment.format(tmp=tmp_path) for fragment in fragments])
    assert "bootstrap" not in result.stderr
    assert not (tmp_path / "home" / "known_bootstraps").exists()


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


@pytest.mark.parametrize("flag, value, fragment", [("--ram", "-5", "--ram -5: "), ("--cores", "0", "--cores 0: ")])
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

    from meshlearn.network.channel.identity import KeyPair

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


# --- suggestions, a short --help, and value errors that name the flag ------------------------

def _said(capsys, *words) -> str:
    """The one line `meshlearn WORDS` answers with on stderr, in this process, and its exit code 2."""
    from meshlearn.cli.main import main

    try:
        code = main(list(words))
    except SystemExit as exit:
        code = exit.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, (code, lines)
    return lines[0]


@pytest.mark.parametrize("words, meant", [
    (["simulate", "--iter", "3"], "did you mean --iterations?"),  # a prefix finds the flag, not --outer
    (["simulate", "--out", "x"], "did you mean --output?"),  # --outer starts so too: the common flag wins
    (["simulate", "--algo", "gossip"], "did you mean --algorithm?"),
    (["simulate", "--nodez", "4"], "did you mean --nodes?"),
    (["simulate", "--port", "7000"], "did you mean --base-port?"),
    (["simulate", "--epochs"], "did you mean --full-epochs?"),  # no value given: the yes/no flag may be meant
    (["simulte"], "'simulte' is not a command: did you mean simulate?"),
    (["sim"], "did you mean simulate?"),
    (["simulate", "--engine", "batch"], "--engine batch: did you mean batched? choose from process, batched"),
    (["simulate", "--algorithm", "gosip"], ("--algorithm gosip: unknown algorithm 'gosip': did you mean gossip? "
                                            "choose one of dadam, dpsgd, fedavg, gossip")),
    (["simulate", "--model", "lenett"], ("--model lenett: unknown model 'lenett': did you mean lenet? choose one of "
                                         "gpt-small, gpt-tiny, lenet, mlp")),
    (["simulate", "--dataset", "digts"], "did you mean digits?"),
    (["simulate", "--optimizer", "adm"], "did you mean adam?"),
    (["simulate", "--net", "los=20%"], "(did you mean loss?)"),
])
def test_a_typo_is_answered_with_what_it_meant(capsys, tmp_path, words, meant):
    line = _said(capsys, *words, *(["--output", str(tmp_path)] if words[0] == "simulate" else []))
    assert meant in line, line
    assert "Traceback" not in line


@pytest.mark.parametrize("words", [["--epochs", "3"], ["--epochs=3"], ["--verbos", "2"]])
def test_a_flag_given_a_value_is_never_answered_with_a_yes_no_flag_or_a_switch(capsys, words):
    line = _said(capsys, "simulate", *words)
    assert "--full-epochs" not in line and "--verbose" not in line and "--quiet" not in line, line
    assert line.endswith("(see meshlearn simulate --help-all)"), line  # nothing close: where every flag is


def test_one_ranking_serves_flags_commands_and_values():
    from meshlearn.suggest import closest, did_you_mean, edit_distance

    assert edit_distance("gosip", "gossip") == 1 and edit_distance("lenet", "lneet") == 1  # a swap is one typo
    assert closest("--iter", ["--outer", "--iterations"]) == "--iterations"  # a prefix beats a near word
    assert closest("--out", ["--output", "--outer"]) == "--output"  # both start so: the earlier, likelier one
    assert closest("--out", ["--outer", "--output"]) == "--outer"
    assert closest("simulte", ["demo", "simulate", "sample"]) == "simulate"
    assert closest("--port", ["--partition", "--base-port"]) == "--base-port"  # a whole last part beats a typo
    assert closest("--Nodes", ["--nodes"]) == "--nodes" and did_you_mean("nodes", ["nodes"]) == ""  # it is one
    assert closest("zebra", ["dpsgd", "gossip", "leader"]) is None and did_you_mean("zebra", ["gossip"]) == ""
    assert closest("x", ["xy", "xz"]) is None  # one letter is the start of too much


def test_simulate_help_is_short_and_says_where_every_flag_is():
    import os

    from meshlearn.cli.main import COMMON_FLAGS, build_parser

    env = {**os.environ, "COLUMNS": "80"}
    short = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--help"], capture_output=True,
                           text=True, timeout=120, env=env, check=False)
    assert short.returncode == 0, short.stderr
    lines = short.stdout.splitlines()
    assert len(lines) < 80 and lines[0] == "usage: meshlearn simulate [options]", short.stdout
    assert "meshlearn simulate --help-all lists every one" in short.stdout.replace("\n", " ")
    assert "docs/settings.md" in short.stdout
    assert all(f"--{dest.replace('_', '-')} " in short.stdout for dests in COMMON_FLAGS.values() for dest in dests)
    assert "--udp-mode" not in short.stdout and "--byzantine" not in short.stdout
    full = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--help-all"], capture_output=True,
                          text=True, timeout=120, env=env, check=False)
    assert full.returncode == 0 and full.stdout.startswith("usage: meshlearn simulate [options]\n"), full.stderr
    every = [option for action in build_parser(user_algorithms=False).commands.choices["simulate"]._actions
             for option in action.option_strings if option.startswith("--")]
    assert len(every) > 60 and all(option in full.stdout for option in every)


@pytest.mark.parametrize("words, line", [
    (["--partition", "shards:abc"], "--partition shards:abc: K must be a whole number >= 1"),
    (["--partition", "dirichlet:0"], "--partition dirichlet:0: ALPHA must be a number > 0"),
    (["--lr", "-1"], "--lr -1: Input should be greater than 0"),
    (["--net", "loss=120%"], "--net loss=120%: '120%' must be a share like 20% (0..100%)"),
    (["--optimizer", "adam:eps=small"], "--optimizer adam:eps=small: 'small' is not a number"),
    (["--dp", "epsilon=x"], "--dp epsilon=x: epsilon must be a number"),
    (["--sharing", "topk:2"], "--sharing topk:2: ALPHA must be in (0, 1]"),
    (["--topology", "regular:x"], "--topology regular:x: 'x' is not a number"),
    (["--udp-mode", "fast"], "--udp-mode fast: choose from sync, async"),
    (["--nodes", "four"], "--nodes four: not a whole number"),
])
def test_a_value_error_names_the_flag_and_the_value_typed(capsys, tmp_path, words, line):
    said = _said(capsys, "simulate", *words, "--output", str(tmp_path))
    assert said.startswith(f"meshlearn simulate: error: {line}"), said


def test_a_value_from_a_config_file_is_named_by_its_key_and_one_from_a_flag_by_the_flag(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text("partition: shards:abc\n")
    _one_line_error(_run("simulate", "--config", str(config), "--output", str(tmp_path / "o")), 2,
                    "meshlearn simulate: error: partition 'shards:abc': K must be a whole number >= 1")
    _one_line_error(_run("simulate", "--config", str(config), "--partition", "kshard:0", "--output",
                         str(tmp_path / "o")), 2, "meshlearn simulate: error: --partition kshard:0: K must be")
