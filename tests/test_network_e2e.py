"""The compute-sharing network end to end: a bootstrap, providers and requesters as separate processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket

import pytest
import torch
import yaml
from helpers.delayproxy import DelayProxy
from helpers.hold import MODELS, Hold
from helpers.netproc import SECRET, Processes, free_port, requester_keys, start_network
from helpers.scoring import score_result
from PIL import Image
from safetensors.torch import load_file, save_file

from meshlearn.data import load_dataset
from meshlearn.models import build_model
from meshlearn.network.channel.addresses import SOME_PUBLIC_ADDRESS, source_address_toward
from meshlearn.network.channel.rpc import call
from meshlearn.network.requester.service import Requester
from meshlearn.network.task.spec import TaskRequest

TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "16"]


def _request(procs: Processes, name: str, bootstrap: str, *args: str, timeout: float = 240, secret: str = SECRET):
    proc = procs.start(name, "request", "--bootstrap", bootstrap, "--output", str(procs.folder / name), *args,
                       secret=secret)
    proc.wait(timeout=timeout)
    return proc.returncode, procs.log(name)


def test_a_request_waits_for_a_provider_that_joins_later_and_says_what_it_waits_for(tmp_path):
    procs = Processes(tmp_path)
    try:
        bootstrap, _ = start_network(procs, 1)
        request = procs.start("req", "request", "--bootstrap", bootstrap, "--output", str(tmp_path / "req"),
                              *TASK, "--epochs", "2", "--providers", "2", "--wait", "120")
        procs.wait_for("req", r"waiting up to \d+ s for 2 free provider\(s\): 1 now")
        procs.start("late", "provider", "--bootstrap", bootstrap, "--id", "late", "--workdir", str(tmp_path / "late"))
        assert request.wait(timeout=180) == 0, procs.log("req")
        metrics = json.loads((tmp_path / "req" / "metrics.json").read_text())
        assert sorted(metrics["providers"]) == ["late", "p0"]
        assert "only 1 provider(s)" not in procs.log("req")
    finally:
        procs.stop_all()


@pytest.mark.slow  # test_insiders leaves a deaf claimed provider out and names it in the default run
def test_a_provider_that_cannot_take_the_task_is_replaced_by_a_fresh_claim_and_the_task_completes(tmp_path):
    procs = Processes(tmp_path)
    try:
        bootstrap, ids = start_network(procs, 3)
        frozen = procs.procs["p1"]
        os.killpg(frozen.pid, signal.SIGSTOP)  # registered and free, but it will never answer task.assign
        request = procs.start("req", "request", "--bootstrap", bootstrap, "--output", str(tmp_path / "req"),
                              *TASK, "--epochs", "2", "--providers", "3", "--wait", "0")
        procs.wait_for("req", r"task \w+: 3 provider\(s\)")
        procs.start("spare", "provider", "--bootstrap", bootstrap, "--id", "spare", "--workdir", str(tmp_path / "spare"))
        assert request.wait(timeout=180) == 0, procs.log("req")
        out = procs.log("req")
        assert "provider p1 refused the task or did not answer" in out and "in place of p1: spare" in out, out
        metrics = json.loads((tmp_path / "req" / "metrics.json").read_text())
        assert sorted(metrics["providers"]) == ["p0", "p2", "spare"], metrics["providers"]
        assert metrics["replaced"] == {"p1": "spare"} and "p1" in metrics["left_out"]
        assert metrics["accuracy"] > 0.5
        record = call(bootstrap, "task", {"task": metrics["task"]}, SECRET.encode(), timeout=10,
                      keys=requester_keys()).body
        assert sorted(p["id"] for p in record["providers"]) == ["p0", "p2", "spare"]  # p1 may no longer act on it
    finally:
        for proc in procs.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
        procs.stop_all()


@pytest.mark.slow  # quick sibling: tests/test_requester_nearest.py
def test_a_request_preferring_the_nearest_takes_the_providers_with_the_lowest_round_trip(tmp_path):
    """Two providers behind a proxy that holds every chunk 40 ms each way (each announces the
    proxy's address), two direct: the nearest are chosen in 10 of 10 trials, and a task claims them."""
    procs, proxies = Processes(tmp_path), []
    try:
        # p0, p1: direct. The bootstrap does not dial providers back: it dials only the address a
        # request came from, and the far ones' come from 127.0.0.3, not from their proxy's 127.0.0.2
        bootstrap, _ = start_network(procs, 2, bootstrap_args=("--dial-back", "false"))
        for name in ("far0", "far1"):
            port = free_port()
            proxies.append(DelayProxy(("127.0.0.2", port), ("127.0.0.3", port), delay=0.04).start())
            procs.start(name, "provider", "--bootstrap", bootstrap, "--id", name, "--host", "127.0.0.3",
                        "--port", str(port), "--advertise", "127.0.0.2", "--workdir", str(tmp_path / name))
        for name in ("far0", "far1"):
            procs.wait_for(name, "registered with")
        request = TaskRequest(data="digits", providers=2, prefer="nearest")
        for _ in range(10):
            order = Requester(request, bootstrap, SECRET.encode(), tmp_path / "unused", say=lambda _: None,
                              keys=requester_keys()).nearest()
            assert sorted(order[:2]) == ["p0", "p1"] and sorted(order[2:]) == ["far0", "far1"], order
        code, out = _request(procs, "req", bootstrap, *TASK, "--epochs", "1", "--providers", "2",
                             "--prefer", "nearest")
        assert code == 0, out
        assert "round-trip times: " in out
        assert sorted(json.loads((tmp_path / "req" / "metrics.json").read_text())["providers"]) == ["p0", "p1"]
    finally:
        procs.stop_all()
        for proxy in proxies:
            proxy.stop()


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    """Three providers; every service listens on all interfaces, as on real machines (README)."""
    processes = Processes(tmp_path_factory.mktemp("net"))
    try:
        bootstrap, ids = start_network(processes, 3, host="0.0.0.0")
        yield processes, bootstrap, ids
    finally:
        processes.stop_all()


@pytest.mark.parametrize("algorithm", ["leader", pytest.param("dpsgd", marks=pytest.mark.slow),
                                       pytest.param("gossip", marks=pytest.mark.slow)])
def test_each_algorithm_returns_a_model_that_scores_what_its_metrics_say(network, algorithm):
    procs, bootstrap, ids = network
    code, out = _request(procs, f"req-{algorithm}", bootstrap, *TASK, "--algorithm", algorithm,
                         "--epochs", "4", "--providers", "5", "--aggregate-every", "5", "--host", "0.0.0.0",
                         "--wait", "0")
    assert code == 0, out
    assert "only 3 provider(s) available of the 5 asked" in out and "waiting" not in out
    folder = procs.folder / f"req-{algorithm}"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["algorithm"] == algorithm and metrics["lost"] == []
    assert sorted(metrics["providers"]) == ids
    assert all(c["samples"] > 400 for c in metrics["providers"].values())
    assert score_result(folder) == pytest.approx(metrics["accuracy"], abs=1e-9)
    assert metrics["accuracy"] > 0.5
    assert (folder / "confusion.png").stat().st_size > 1000 and (folder / "task.yaml").exists()
    with Image.open(folder / "predictions.png") as grid:  # the result model on a grid of test images
        assert grid.width > grid.height > 400
    assert "predictions.png" in out.splitlines()[-1]
    assert sum(map(sum, metrics["confusion"])) == metrics["test_samples"] == len(load_dataset("digits").test_y)
    # every provider keeps a copy, and `meshlearn results` fetches it later
    task_id = re.search(r"task (\w+) done", out).group(1)
    for pid in ids:
        assert (procs.folder / pid / "tasks" / task_id / "result" / "model.safetensors").exists()
    again = procs.start(f"res-{algorithm}", "results", task_id, "--bootstrap", bootstrap,
                        "--output", str(procs.folder / f"res-{algorithm}"))
    assert again.wait(timeout=60) == 0, procs.log(f"res-{algorithm}")
    assert score_result(procs.folder / f"res-{algorithm}") == pytest.approx(metrics["accuracy"], abs=1e-9)
    fetched = yaml.safe_load((procs.folder / f"res-{algorithm}" / "task.yaml").read_text())
    asked = yaml.safe_load((folder / "task.yaml").read_text())
    assert fetched["task"] == asked["task"] and fetched["task"]["algorithm"] == algorithm


@pytest.mark.slow  # test_network_sync's FedAvg task and tests/test_outer.py's rules run in the default run
def test_a_fedavg_task_with_an_outer_optimizer_completes_between_providers(network):
    """DiLoCo's shape between real providers: FedAvg (the synchronous leader) every 5 batches, each
    provider taking Nesterov's outer step on the aggregate; a task the asynchronous leader would
    refuse is refused before any provider is claimed."""
    procs, bootstrap, ids = network
    code, out = _request(procs, "req-outer", bootstrap, *TASK, "--algorithm", "fedavg", "--epochs", "2",
                         "--providers", "3", "--aggregate-every", "5", "--outer", "nesterov:lr=0.7,momentum=0.9",
                         "--wait", "0")
    assert code == 0, out
    folder = procs.folder / "req-outer"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["algorithm"] == "fedavg" and sorted(metrics["providers"]) == ids and metrics["accuracy"] > 0.5
    assert score_result(folder) == pytest.approx(metrics["accuracy"], abs=1e-9)
    assert yaml.safe_load((folder / "task.yaml").read_text())["task"]["outer"] == "nesterov:lr=0.7,momentum=0.9"
    code, out = _request(procs, "req-outer-async", bootstrap, *TASK, "--algorithm", "leader", "--outer", "adam",
                         "--wait", "0")  # the asynchronous leader answers each push at once: no round to step after
    assert code == 2 and "needs aggregations every member takes at once" in out and "Traceback" not in out
    code, out = _request(procs, "req-outer-int8", bootstrap, *TASK, "--algorithm", "fedavg", "--fedavg-compress",
                         "int8", "--wait", "0")  # the simulators' quantized changes: not in network tasks (yet)
    assert code == 2 and "run in simulations" in out and "Traceback" not in out


@pytest.mark.slow  # the default run trains a gpt in simulations and every algorithm's task over the network
def test_a_language_model_task_trains_a_gpt_on_text_and_returns_a_model_of_the_perplexity_it_reports(
        network, tmp_path):
    from meshlearn.data.text import stdlib_files
    from meshlearn.evaluation import evaluate_model

    procs, bootstrap, ids = network
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, path in enumerate(stdlib_files()[:20]):  # 20 files: the 10th and 20th held out for testing
        (corpus / f"{i:02d}.txt").write_bytes(path.read_bytes()[:3000])
    # characters as tokens: the providers build the model the requester's vocabulary needs
    code, out = _request(procs, "req-lm", bootstrap, "--data", f"text:{corpus}", "--model", "gpt-tiny",
                         "--context", "32", "--vocabulary", "chars", "--epochs", "1", "--providers", "2", "--batch-size", "16", "--lr", "0.3",
                         "--eval-samples", "64", "--wait", "0")
    assert code == 0, out
    assert re.search(r"task \w+ done: perplexity [\d.]+  bits per token", out), out
    folder = procs.folder / "req-lm"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["model"] == "gpt-tiny" and metrics["perplexity"] < 100 and not metrics.get("confusion")
    text = load_dataset(f"text:{corpus}", context=32, vocabulary="chars")
    assert text.num_classes < 256
    model = build_model("gpt-tiny", (32,), text.num_classes)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    ours = evaluate_model(model, text, limit=64)
    assert ours.perplexity == pytest.approx(metrics["perplexity"], rel=1e-5)


def test_services_listening_on_every_interface_announce_addresses_peers_can_reach(network):
    procs, bootstrap, ids = network
    host = bootstrap.rpartition(":")[0]
    assert host != "0.0.0.0" and "0.0.0.0" in procs.log("bootstrap")
    if source_address_toward(*SOME_PUBLIC_ADDRESS) not in (None, "127.0.0.1"):  # a machine with a network
        assert not host.startswith("127."), procs.log("bootstrap")
    found = call(bootstrap, "discover", {"free_only": False}, SECRET.encode(), timeout=10).body["providers"]
    assert sorted(p["id"] for p in found) == ids
    for provider in found:
        assert provider["address"].rpartition(":")[0] == host  # one machine: the bootstrap's address
        assert call(provider["address"], "ping", {}, SECRET.encode(), timeout=10).body["id"] == provider["id"]


def test_a_task_that_cannot_start_fails_clearly_and_frees_its_providers(network, tmp_path):
    procs, bootstrap, ids = network
    # A custom model the requester registers but the providers do not: it passes the requester's
    # checks and fails where the task is prepared (unknown names fail before any claim, see test_cli)
    module = tmp_path / "requester_models.py"
    module.write_text("from torch import nn\nfrom meshlearn.models import register_model\n\n"
                      "@register_model('no-such-model')\ndef build(shape, classes):\n"
                      "    return nn.Sequential(nn.Flatten(), nn.Linear(shape[0] * shape[1] * shape[2], classes))\n")
    code, out = _request(procs, "req-bad-model", bootstrap, "--data", "digits", "--model", "no-such-model",
                         "--providers", "3", "--models-module", str(module))
    assert code == 1 and "could not prepare the task" in out and "unknown model 'no-such-model'" in out, out
    assert "Traceback" not in out
    free = call(bootstrap, "discover", {"count": 10}, SECRET.encode(), timeout=5).body["providers"]
    assert sorted(p["id"] for p in free) == ids
    task_id = re.search(r"task (\w+): 3 provider", out).group(1)
    for provider in free:  # each has stopped the task (none still downloading its data), so it takes the next one
        state = call(provider["address"], "task.status", {"task": task_id}, SECRET.encode(), timeout=5,
                     keys=requester_keys()).body["state"]
        assert state in ("failed", "cancelled"), (provider["id"], state)


def test_data_the_providers_already_hold_is_not_sent(network):
    procs, bootstrap, ids = network
    code, out = _request(procs, "req-local", bootstrap, "--data-on-providers", "digits", "--model", "mlp",
                         "--lr", "0.05", "--epochs", "3", "--providers", "3", "--aggregate-every", "5")
    assert code == 0, out
    metrics = json.loads((procs.folder / "req-local" / "metrics.json").read_text())
    assert sum(c["samples"] for c in metrics["providers"].values()) == len(load_dataset("digits").train_y)
    assert score_result(procs.folder / "req-local") == pytest.approx(metrics["accuracy"], abs=1e-9)


def test_a_requester_whose_port_is_taken_serves_its_data_on_another(network):
    procs, bootstrap, _ = network
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = _request(procs, "req-port", bootstrap, *TASK, "--epochs", "1", "--providers", "3",
                             "--host", "0.0.0.0", "--port", str(port))
    assert code == 0, out
    assert re.search(rf"port {port} is in use: serving the task's data on \d+ instead", out), out


def test_a_requester_supplied_weights_file_is_where_training_starts(network, tmp_path):
    procs, bootstrap, ids = network
    dataset = load_dataset("digits")
    torch.manual_seed(123)
    start = build_model("mlp", dataset.input_shape, dataset.num_classes).state_dict()
    save_file(start, str(tmp_path / "start.safetensors"))
    code, out = _request(procs, "req-weights", bootstrap, *TASK, "--lr", "1e-9", "--epochs", "1", "--providers", "3",
                         "--weights", str(tmp_path / "start.safetensors"))
    assert code == 0, out
    got = load_file(str(procs.folder / "req-weights" / "model.safetensors"))
    torch.manual_seed(90)
    seeded = build_model("mlp", dataset.input_shape, dataset.num_classes).state_dict()
    for name, tensor in start.items():  # a learning rate of 1e-9 leaves the given weights as they were
        assert torch.allclose(got[name], tensor, atol=1e-6), name
        assert not torch.allclose(seeded[name], tensor, atol=1e-3) or tensor.numel() == 0
    save_file(build_model("lenet", (3, 32, 32), 10).state_dict(), str(tmp_path / "lenet.safetensors"))
    code, out = _request(procs, "req-misfit", bootstrap, *TASK, "--providers", "3",
                         "--weights", str(tmp_path / "lenet.safetensors"))
    # refused by the requester itself now, before any provider is claimed (issue 15)
    assert code == 2 and "weights file does not fit the model" in out and "Traceback" not in out, out
    assert "provider" not in out.split("weights file")[0], out


def test_a_wrong_secret_can_neither_register_nor_read_results(network):
    procs, bootstrap, ids = network
    procs.start("intruder", "provider", "--bootstrap", bootstrap, "--id", "intruder",
                           "--workdir", str(procs.folder / "intruder"), secret="not-the-network-secret")
    try:
        found = procs.wait_for("intruder", "cannot use the bootstrap|cannot register", timeout=60)
        assert "different secret" in found.string or "signature" in found.string
    finally:
        procs.kill("intruder")
    listed = call(bootstrap, "discover", {"count": 10, "free_only": False}, SECRET.encode(), timeout=5).body
    assert "intruder" not in [p["id"] for p in listed["providers"]]
    code, out = _request(procs, "req-intruder", bootstrap, *TASK, secret="not-the-network-secret")
    assert code != 0 and "different secret" in out and "Traceback" not in out
    reader = procs.start("read-intruder", "results", "0123456789ab", "--bootstrap", bootstrap,
                         secret="not-the-network-secret")
    assert reader.wait(timeout=60) != 0 and "different secret" in procs.log("read-intruder")


# Kills in the middle of a task (a follower, the leader, the bootstrap): tests/test_chaos.py.


def test_a_provider_leaves_with_confirmation_on_ctrl_c(procs):
    bootstrap, ids = start_network(procs, 1)
    procs.procs["p0"].send_signal(signal.SIGINT)
    assert procs.procs["p0"].wait(timeout=30) == 0
    assert "left the network (confirmed by" in procs.log("p0")
    listed = call(bootstrap, "discover", {"count": 10, "free_only": False}, SECRET.encode(), timeout=5).body
    assert listed["providers"] == []


def test_a_provider_whose_port_is_taken_picks_another(procs):
    bootstrap, _ = start_network(procs, 0)
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        procs.start("late", "provider", "--bootstrap", bootstrap, "--id", "late", "--port", str(port),
                    "--workdir", str(procs.folder / "late"))
        found = procs.wait_for("late", r"port \d+ is in use: listening on (\d+) instead")
        assert int(found.group(1)) != port
        procs.wait_for("late", "registered with")


@pytest.mark.slow  # test_cli refuses bad requests before any provider is claimed, in the default run
def test_request_refuses_bad_input_in_one_line(procs, tmp_path):
    port = free_port()
    for args, text in [(["--bootstrap", "127.0.0.1:70000", "--data", "digits"], "outside 1..65535"),
                       (["--bootstrap", f"127.0.0.1:{port}", "--data", str(tmp_path / "nope")], "does not exist"),
                       (["--bootstrap", f"127.0.0.1:{port}", "--data", "digits", "--port", "99999"], "outside"),
                       (["--bootstrap", f"127.0.0.1:{port}", "--data", "digits", "--algorithm", "x"], "algorithm"),
                       (["--bootstrap", f"127.0.0.1:{port}", "--data", "digits", "--weights", str(tmp_path / "w")],
                        "weights file"),
                       (["--bootstrap", f"127.0.0.1:{port}", "--data", "digits", "--weights", __file__],
                        "not a safetensors file")]:
        name = f"bad{len(procs.procs)}"
        proc = procs.start(name, "request", *args)
        assert proc.wait(timeout=60) == 2, procs.log(name)
        out = procs.log(name).strip()
        assert text in out and len(out.splitlines()) == 1 and "Traceback" not in out


@pytest.mark.slow
def test_simulated_leader_aggregation_matches_the_networks_on_the_same_partitions_and_seed(network, tmp_path):
    """`meshlearn simulate --algorithm leader` runs CloudMesh's scheme as the providers do: same
    shards, initial model and batch order; asynchrony moves the result by about a point at most."""
    from meshlearn.config import make_config
    from meshlearn.network.task.spec import TaskSpec
    from meshlearn.sim import simulate

    procs, bootstrap, ids = network
    epochs, every, seed = 20, 5, 11
    code, out = _request(procs, "req-leader-vs-sim", bootstrap, *TASK, "--algorithm", "leader", "--epochs",
                         str(epochs), "--aggregate-every", str(every), "--providers", "3", "--seed", str(seed))
    assert code == 0, out
    network_accuracy = json.loads((procs.folder / "req-leader-vs-sim" / "metrics.json").read_text())["accuracy"]
    task = yaml.safe_load((procs.folder / "req-leader-vs-sim" / "task.yaml").read_text())["task"]
    spec = TaskSpec.parse({**task, "data": {"mode": "served"}})  # the spec the providers ran
    rounds, iterations = spec.schedule(len(load_dataset("digits").train_y) // 3)
    config = make_config({"nodes": 3, "algorithm": "leader", "topology": "full", "dataset": "digits", "model": "mlp",
                          "lr": 0.05, "batch_size": 16, "rounds": rounds, "iterations": iterations, "test_after": iterations,
                          "seed": seed, "output": str(tmp_path / "sim")})
    result = simulate(config, progress=False)
    simulated = json.loads((result.output / "summary.json").read_text())["final"]["accuracy"]
    # both leaders are asynchronous: the same task, seed and code land apart from run to run (six runs each,
    # 2026-11-24: the network 0.947-0.964, the simulation 0.944-0.961; 0.0167 apart once under the whole
    # suite's load), so the simulation is held to 0.02 (seven test images of 359)
    assert network_accuracy > 0.9 and abs(simulated - network_accuracy) <= 0.02, (simulated, network_accuracy)



@pytest.mark.slow  # test_aggregation refuses and names a poisoning node in the default run
def test_a_robust_rule_keeps_a_task_with_a_poisoning_provider_on_course_and_names_it(procs):
    """A clean task on four providers; then one leaves and a provider sending sign-flipped models
    (the test-only MESHLEARN_TEST_POISON) takes its place: with the trimmed mean the task scores
    within 3 points of the clean one, and its metrics name the bad provider."""
    bootstrap, ids = start_network(procs, 4)
    task = [*TASK, "--algorithm", "dpsgd", "--epochs", "3", "--providers", "4", "--aggregate-every", "5",
            "--aggregation", "trimmed-mean:1"]
    code, out = _request(procs, "req-clean", bootstrap, *task)
    assert code == 0, out
    procs.procs["p3"].send_signal(signal.SIGINT)
    assert procs.procs["p3"].wait(timeout=30) == 0
    # the leader (the first provider, by id) computes the result: a rule cannot stop a bad leader
    procs.start("zbad", "provider", "--bootstrap", bootstrap, "--id", "zbad", "--host", "127.0.0.1",
                "--workdir", str(procs.folder / "zbad"), env={"MESHLEARN_TEST_POISON": "sign-flip:10"})
    procs.wait_for("zbad", "registered with")
    code, out = _request(procs, "req-poisoned", bootstrap, *task)
    assert code == 0, out
    assert "suspected: zbad" in out
    clean, poisoned = (json.loads((procs.folder / name / "metrics.json").read_text())
                       for name in ("req-clean", "req-poisoned"))
    assert sorted(poisoned["providers"]) == ["p0", "p1", "p2", "zbad"] and poisoned["leader"] == "p0"
    assert clean["suspected"] == [] and poisoned["suspected"] == ["zbad"]
    assert poisoned["aggregation"] == "trimmed-mean:1" and clean["accuracy"] > 0.7
    assert poisoned["accuracy"] >= clean["accuracy"] - 0.03


@pytest.mark.slow  # a provider leaving on Ctrl-C, and the registry's left_since (test_registry), in the default run
def test_a_provider_that_leaves_after_its_task_is_not_reported_lost(procs):
    """Ctrl-C on a provider during a task: it says it leaves after the task, finishes its part and
    goes; the requester must not call it lost (issue 33 item 5)."""
    hold = Hold(procs.folder, 12)  # the task waits at its providers' 12th step (cycle 3) while p1 is told to leave
    bootstrap, ids = start_network(procs, 2, provider_args=("--models-module", MODELS), provider_env=hold.env)
    proc = procs.start("req", "request", "--bootstrap", bootstrap, "--output", str(procs.folder / "req"), *TASK,
                       "--model", "held-mlp", "--models-module", MODELS,
                       "--algorithm", "leader", "--epochs", "2", "--providers", "2", "--aggregate-every", "5")
    hold.wait_held(procs, ids)
    procs.procs["p1"].send_signal(signal.SIGINT)
    procs.wait_for("p1", "leaving after task")
    hold.release()
    assert proc.wait(timeout=240) == 0, procs.log("req")
    assert procs.procs["p1"].wait(timeout=60) == 0
    out = procs.log("req")
    assert "stopped answering" not in out, out
    metrics = json.loads((procs.folder / "req" / "metrics.json").read_text())
    assert metrics["lost"] == [] and metrics["providers"]["p1"]["status"] == "finished"
