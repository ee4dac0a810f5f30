"""Checkpoints and resume: the file format (safetensors + JSON, checked, atomic, bounded), the
batched engine resuming to the very models of a run never interrupted, the process engine
resuming after every process was killed, and one line for each thing that cannot be resumed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hold import MODELS, Hold
from safetensors.torch import load_file

from meshlearn.checkpoint import FOLDER, CheckpointStore, RunCheckpoints, Stateful, capture, restore
from meshlearn.config import make_config
from meshlearn.errors import CheckpointError
from meshlearn.runlog import read_jsonl, truncate_log
from meshlearn.sim import simulate
from meshlearn.sim.resume import resume_point, saved_config

SMALL = {"nodes": 6, "dataset": "digits", "model": "mlp", "iterations": 30, "test_after": 5, "seed": 3,
         "checkpoint_every": 5}


class _Part(Stateful):
    state_fields = ("weights", "order", "draws", "seen", "by_peer", "child")

    def __init__(self, child=None):
        self.weights = torch.arange(6.0)
        self.order = np.arange(4)
        self.draws = np.random.default_rng(5)
        self.seen = 0
        self.by_peer: dict[int, torch.Tensor] = {}
        self.child = child


def test_a_captured_state_is_written_back_in_place_and_survives_the_disk(tmp_path):
    part = _Part(child=_Part())
    view = part.weights[2:4]  # a view of the state, as a model's parameters are of its flat vector
    part.seen, part.by_peer = 7, {3: torch.ones(2)}
    part.child.order[:] = [3, 2, 1, 0]
    expected_draw = np.random.default_rng(5).random()
    store = CheckpointStore(tmp_path / FOLDER)
    store.save(10, "w", {"part": capture(part)}, {"note": "x"})
    part.weights.zero_()
    part.draws.random(3)
    part.seen, part.by_peer, part.child.order[:] = 0, {}, 0
    meta, tree = store.load(10, "w")
    assert meta["note"] == "x" and meta["iteration"] == 10
    restore(part, tree["part"])
    assert torch.equal(part.weights, torch.arange(6.0)) and torch.equal(view, torch.tensor([2.0, 3.0]))
    assert part.draws.random() == expected_draw and part.seen == 7
    assert list(part.by_peer) == [3] and torch.equal(part.by_peer[3], torch.ones(2))
    assert part.child.order.tolist() == [3, 2, 1, 0]
    wrong = _Part()
    wrong.weights = torch.zeros(5)  # another model: refused, not reshaped
    with pytest.raises(CheckpointError, match=r"weights is torch.float32 \(6,\), the run's torch.float32 \(5,\)"):
        restore(wrong, tree["part"])


def test_a_store_keeps_the_newest_and_refuses_damaged_files(tmp_path):
    store = CheckpointStore(tmp_path / FOLDER, keep=2)
    for iteration in (5, 10, 15):
        for name in ("a", "b"):
            store.save(iteration, name, {"x": capture(torch.full((3,), float(iteration)))}, {})
    assert store.iterations() == [10, 15] and store.latest(["a", "b"]) == 15
    assert not list((tmp_path / FOLDER).rglob(".*partial"))  # nothing half-written left behind
    (store.folder(15) / "b.json").unlink()  # a writer that died before finishing its checkpoint
    assert store.latest(["a", "b"]) == 10
    tensors = store.folder(10) / "a.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        store.load(10, "a")
    (store.folder(10) / "b.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        store.load(10, "b")
    with pytest.raises(CheckpointError, match="incomplete"):
        store.load(15, "b")
    checkpoints = RunCheckpoints(tmp_path, "a", "one-run")
    checkpoints.save(20, {"x": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="of another configuration"):
        RunCheckpoints(tmp_path, "a", "another-run").load(20)


def test_a_cut_log_keeps_what_was_logged_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "node_0.jsonl"
    events = [{"event": "start"}] + [{"event": "iteration", "iteration": i} for i in range(8)] + \
        [{"event": "eval", "iteration": 5}, {"event": "eval", "iteration": 8}, {"event": "final"}]
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    truncate_log(path, 5)
    assert [(e["event"], e.get("iteration")) for e in read_jsonl(path)] == \
        [("start", None)] + [("iteration", i) for i in range(5)] + [("eval", 5)]


def _stopped_at(config, done: int):
    """Run ``config`` on the batched engine and stop it once ``done`` iterations are done (an
    exception out of its progress hook: the process lives on, the run is as a killed one left it)."""
    import meshlearn.batched.engine as engine

    class Stop(Exception):
        pass

    original = engine.BatchedSimulation.__init__

    def stopping(self, *args, **kwargs):
        original(self, *args, **kwargs)

        def progress(at):
            if at == done:
                raise Stop

        self.progress = progress

    engine.BatchedSimulation.__init__ = stopping
    try:
        with pytest.raises(Stop):
            simulate(config, progress=False)
    finally:
        engine.BatchedSimulation.__init__ = original


def _same_results(a: Path, b: Path) -> None:
    first, second = json.loads((a / "summary.json").read_text()), json.loads((b / "summary.json").read_text())
    for rank, node in first["per_node"].items():
        assert node["metrics"] == second["per_node"][rank]["metrics"], f"node {rank}"
        assert node["stats"] == second["per_node"][rank]["stats"] and node["elapsed"] == second["per_node"][rank]["elapsed"]
    models = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(models[0][name], models[1][name]) for name in models[0])


@pytest.mark.parametrize("extra", [
    {},
    {"algorithm": "fedavg", "fedavg_compress": "int4", "fedavg_fragments": 2, "outer": "nesterov:lr=0.7,momentum=0.9"},
    # the cohort path: clients drawn again take their momentum and batch stream on, from files past a tiny budget
    {"algorithm": "fedavg", "fedavg_cohort": 2, "momentum": 0.9, "batched_client_memory": 20_000},
    pytest.param({"sharing": "choco:0.3", "transport": "udp", "net": "loss=10%", "momentum": 0.9},
                 marks=pytest.mark.slow),
    pytest.param({"optimizer": "adam", "lr": 0.01, "lr_schedule": "cosine", "peer_sampling": "epidemic:2"},
                 marks=pytest.mark.slow),
    # what an optimizer over the graph adds to its state when handed the optimizer: a tracker, a buffer (and
    # the optimizer kept under the samples' weights; accelerated exchanges keep nothing between iterations)
    {"algorithm": "gtadam", "optimizer": "adamw", "lr": 0.01, "lr_schedule": "cosine", "rounds": 1,
     "objective": "samples", "mixing_steps": 3, "mixing_accelerated": True},
    pytest.param({"algorithm": "qgdsgdm", "momentum": 0.9, "rounds": 1}, marks=pytest.mark.slow),
], ids=["dpsgd", "fedavg-int4-fragments-outer", "fedavg-cohort-momentum-spill", "choco-udp-loss", "adam-cosine-epidemic",
        "gtadam-cosine-samples-mixing", "qgdsgdm"])
def test_the_batched_engine_resumes_to_the_models_of_a_run_never_interrupted(tmp_path, extra):
    values = {**SMALL, "engine": "batched", **extra}
    simulate(make_config({**values, "output": str(tmp_path / "whole")}), progress=False)
    _stopped_at(make_config({**values, "output": str(tmp_path / "cut")}), 17)
    config = saved_config(tmp_path / "cut")
    assert resume_point(config) == 15
    simulate(config, progress=False, resume=15)
    _same_results(tmp_path / "whole", tmp_path / "cut")
    log = list(read_jsonl(tmp_path / "cut" / "logs" / "nodes.jsonl"))
    assert [e["iteration"] for e in log if e["event"] == "iteration"] == list(range(30))  # each once
    assert [e["event"] for e in log].count("resumed") == 1


def _meshlearn(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshlearn", *args], capture_output=True, text=True, timeout=300,
                          **kwargs)


def _kill_when(folder: Path, argv: list[str], ready, env: dict | None = None) -> None:
    """Start ``meshlearn simulate`` (with ``env`` added to its environment) in a process group of its
    own and SIGKILL the whole group (the launcher and every node process) once ``ready(folder)``."""
    proc = subprocess.Popen([sys.executable, "-m", "meshlearn", "simulate", *argv, "--output", str(folder),
                             "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 240
        while not ready(folder):
            assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "the run never reached the point to kill it at"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@pytest.mark.slow  # its quick sibling: the run stopped in-process above, resumed to the same models
def test_a_batched_run_killed_at_iteration_50_of_100_resumes_to_the_same_final_models(tmp_path):
    argv = ["--engine", "batched", "--nodes", "8", "--iterations", "100", "--test-after", "10", "--seed", "7",
            "--checkpoint-every", "10", "--model", "held-mlp", "--models-module", MODELS]  # mlp, held at a step
    whole = _meshlearn("simulate", *argv, "--output", str(tmp_path / "whole"), "--quiet")
    assert whole.returncode == 0, whole.stderr
    hold = Hold(tmp_path, 61)  # its 61st forward step (it takes a few before its first iteration): about half-way
    _kill_when(tmp_path / "cut", argv, lambda folder: hold.held() == 1, env=hold.env)
    hold.release()
    assert 0 < (CheckpointStore(tmp_path / "cut" / FOLDER).latest(["nodes"]) or 0) < 100
    assert not (tmp_path / "cut" / "summary.json").exists()
    resumed = _meshlearn("simulate", "--resume", str(tmp_path / "cut"), "--quiet", "--models-module", MODELS)
    assert resumed.returncode == 0, resumed.stderr
    _same_results(tmp_path / "whole", tmp_path / "cut")


@pytest.mark.slow  # 30 s; quick siblings: the process engine's nodes resuming each from its own checkpoint, below
def test_a_process_engine_run_killed_whole_resumes_within_noise(tmp_path):
    argv = ["--nodes", "4", "--iterations", "40", "--test-after", "5", "--seed", "4", "--checkpoint-every", "5",
            "--model", "held-mlp", "--models-module", MODELS]  # mlp, held at a step (helpers/hold.py)
    whole = _meshlearn("simulate", *argv, "--output", str(tmp_path / "whole"), "--quiet")
    assert whole.returncode == 0, whole.stderr
    nodes = [f"node-{r}" for r in range(4)]
    # killed half-way: every node waits before its 23rd step (iteration 23 of 40), its checkpoint at 20 written
    hold = Hold(tmp_path, 23)
    _kill_when(tmp_path / "cut", argv, lambda folder: hold.held() == 4, env=hold.env)
    hold.release()  # the resumed run trains straight through
    at = CheckpointStore(tmp_path / "cut" / FOLDER).latest(nodes)
    assert at == 20
    resumed = _meshlearn("simulate", "--resume", str(tmp_path / "cut"), "--models-module", MODELS)  # the run's own
    assert resumed.returncode == 0, resumed.stderr
    assert f"from its checkpoint at iteration {at} of 40" in resumed.stderr
    first, second = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("whole", "cut"))
    assert abs(first["final"]["accuracy"] - second["final"]["accuracy"]) <= 0.01
    for rank in range(4):
        log = list(read_jsonl(tmp_path / "cut" / "logs" / f"node_{rank}.jsonl"))
        assert [e["iteration"] for e in log if e["event"] == "iteration"] == list(range(40))
        assert [e["event"] for e in log].count("start") == 1 and [e["event"] for e in log][-1] == "final"


def test_what_cannot_be_resumed_is_one_line_and_leaves_the_folder_as_it_was(tmp_path):
    empty = _meshlearn("simulate", "--resume", str(tmp_path))
    assert empty.returncode == 2 and "holds no run (no readable config.yaml)" in empty.stderr
    assert len(empty.stderr.strip().splitlines()) == 1
    config = make_config({**SMALL, "engine": "batched", "output": str(tmp_path / "cut")})
    _stopped_at(config, 12)
    cut = tmp_path / "cut"
    before = (cut / "logs" / "nodes.jsonl").read_bytes()
    changed = _meshlearn("simulate", "--resume", str(cut), "--lr", "0.2")
    assert changed.returncode == 2 and "these differ from it: lr" in changed.stderr
    tensors = CheckpointStore(cut / FOLDER).folder(10) / "nodes.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-8])
    damaged = _meshlearn("simulate", "--resume", str(cut))
    assert damaged.returncode == 2 and "does not match its checksum" in damaged.stderr
    assert len(damaged.stderr.strip().splitlines()) == 1
    assert (cut / "logs" / "nodes.jsonl").read_bytes() == before and not (cut / "summary.json").exists()
    other = make_config({**SMALL, "engine": "batched", "output": str(tmp_path / "other"), "seed": 4})
    _stopped_at(other, 12)
    (cut / FOLDER / "00000010").rename(cut / FOLDER / "gone")
    os.replace(tmp_path / "other" / FOLDER / "00000010", cut / FOLDER / "00000010")  # another run's
    foreign = _meshlearn("simulate", "--resume", str(cut))
    assert foreign.returncode == 2 and "of another configuration" in foreign.stderr
    gossip = make_config({**SMALL, "engine": "batched", "algorithm": "gossip", "output": str(tmp_path / "g")})
    simulate(gossip, progress=False)
    (tmp_path / "g" / "summary.json").unlink()
    refused = _meshlearn("simulate", "--resume", str(tmp_path / "g"))
    assert refused.returncode == 2 and "keeps no checkpoints (its nodes are asynchronous)" in refused.stderr


def test_an_experiment_run_stopped_half_way_goes_on_from_its_checkpoint(tmp_path):
    from meshlearn.sim.experiment import load_experiment, run_experiment

    path = tmp_path / "e.yaml"
    path.write_text("name: e\nbase: {engine: batched, nodes: 6, iterations: 30, test_after: 5, seed: 3, "
                    "checkpoint_every: 5}\nruns:\n  - {name: a}\n  - {name: b, lr: 0.1}\n")
    experiment = load_experiment(path, quick=False, output=tmp_path / "out")
    _stopped_at(dict(experiment.runs)["b"], 22)
    said: list[str] = []
    run_experiment(experiment, progress=False, log=said.append)
    assert any(line.startswith("[2/2] b: ") and "resumed at iteration 20 of 30" in line for line in said)
    log = list(read_jsonl(tmp_path / "out" / "b" / "logs" / "nodes.jsonl"))
    assert [e["iteration"] for e in log if e["event"] == "iteration"] == list(range(30))
    said.clear()
    run_experiment(experiment, progress=False, log=said.append, resume=False)  # --restart: both afresh
    assert not any("kept" in line or "resumed" in line for line in said)


def test_asynchronous_nodes_of_the_process_engine_resume_each_from_its_own_newest_checkpoint(tmp_path):
    """Gossip's nodes run at their own pace, often further apart than the checkpoints kept: each
    goes on from its own; D-PSGD's restart together, from the newest they all reached."""
    for algorithm, reached, expected in (("gossip", (20, 30, 10), [20, 30, 10]), ("dpsgd", (20, 25, 20), 20)):
        folder = tmp_path / algorithm
        config = make_config({**SMALL, "nodes": 3, "algorithm": algorithm, "output": str(folder)})
        (folder / "logs").mkdir(parents=True)
        for rank, newest in enumerate(reached):
            store = RunCheckpoints(folder, f"node-{rank}", config.fingerprint())
            for iteration in range(10, newest + 1, 5):
                store.save(iteration, {"x": torch.zeros(1)})
        assert resume_point(config) == expected
