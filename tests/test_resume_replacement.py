"""A task that took in a provider at a lost one's place resumes on the newcomer, not the provider
it lost: the record names the provider holding each position (a data shard) when it is written,
the requester keeps each position's checkpoints under its name, written by the provider holding it
now, and a resume claims those providers, each for its own position."""

from __future__ import annotations

import json

import pytest
from helpers.hold import MODELS, Hold
from helpers.netproc import Processes, start_network
from helpers.waiting import wait_until

from meshlearn.checkpoint import FOLDER, CheckpointStore, RunCheckpoints
from meshlearn.errors import CheckpointError
from meshlearn.network.channel.envelope import BadMessage
from meshlearn.network.task.spec import Peer, TaskRequest, TaskSpec
from meshlearn.network.task.state import KeptCheckpoints, TaskRecord, checkpoint_name

# mlp held at named steps while the test kills a provider, takes in a spare and kills the task (helpers/hold.py)
TASK = ["--data", "digits", "--model", "held-mlp", "--models-module", MODELS, "--lr", "0.05", "--batch-size", "8",
        "--wait", "0", "--algorithm", "fedavg", "--epochs", "4", "--aggregate-every", "2", "--providers", "3",
        "--min-providers", "2", "--peer-timeout", "10", "--checkpoint-every", "2"]
# the providers hold at their 7th step (cycle 3) while one is killed, at their 41st (cycle 20 of 60) until the
# spare has joined, and at their 61st, once each position has sent its checkpoint of cycle 30
KILL_AT, JOIN_AT, CUT_AT = 7, 41, 61
CUT_CYCLE = (CUT_AT - 1) // 2  # two steps a cycle (--aggregate-every 2), a checkpoint every two cycles
POSITIONS = [checkpoint_name(position) for position in range(3)]


def _spec() -> TaskSpec:
    """A task of three slots whose provider 0 was lost and whose ``spare`` (provider 3) took its shard."""
    peers = [{"id": pid, "address": f"127.0.0.1:{9000 + i}"} for i, pid in enumerate(["p0", "p1", "p2"])]
    return TaskSpec(task_id="t1", model="mlp", epochs=2, batch_size=8, lr=0.1, algorithm="fedavg",
                    aggregate_every="epoch", seed=1, partition="iid", eval_samples=0, peer_timeout=5, slots=3,
                    peers=[*peers, {"id": "spare", "address": "127.0.0.1:9003", "shard": 0}],
                    data={"mode": "local", "dataset": "digits"})


def _sent(tmp_path, spec: TaskSpec, index: int, cycle: int) -> list[bytes]:
    """Provider ``index``'s checkpoint of ``cycle`` as it sends it (its JSON, its tensors)."""
    import torch

    sent = RunCheckpoints(tmp_path / f"provider-{index}", checkpoint_name(index), spec.fingerprint())
    sent.save(cycle, {"model": {"w": torch.full((4,), float(index))}})
    folder = sent.store.folder(cycle)
    return [(folder / f"{checkpoint_name(index)}{suffix}").read_bytes() for suffix in (".json", ".safetensors")]


def test_a_newcomer_at_a_lost_provider_s_place_holds_its_position_in_the_checkpoints_and_the_record(tmp_path):
    spec = _spec()
    before = spec.model_copy(update={"peers": spec.peers[:3]})  # the attempt until the spare came
    kept = KeptCheckpoints(tmp_path / "requester")

    def take(index: int, cycle: int, running: TaskSpec = spec) -> int:
        return kept.take(running, "t1", index, cycle, *_sent(tmp_path, running, index, cycle), lambda index: None)

    assert take(0, 2, before) == 2  # the lost provider's, while it held its place: position 0's
    for index in (1, 2, 3):
        assert take(index, 6) == 6
    with pytest.raises(BadMessage, match="provider 0 of task t1 lost its place \\(shard 0\\) to provider 3"):
        take(0, 8)  # the lost provider, still sending: never over the spare's
    assert kept.resume_cycles(3, in_step=True) == [6, 6, 6]  # the spare's of cycle 6 is position 0's
    meta, _ = kept.store.load(6, "provider-0")
    assert meta["fingerprint"] == spec.fingerprint() and not kept.store.has(8, "provider-0")
    served = kept.files([6, 6, 6])["provider-0.safetensors"].read_bytes()
    assert served == _sent(tmp_path / "again", spec, 3, 6)[1]  # provider 0 of the resume gets the spare's

    record = TaskRecord("t1", TaskRequest(data_on_providers="digits", providers=3, min_providers=2), "digest")
    record.note(spec)
    record.write(tmp_path / "requester")
    again = TaskRecord.read(tmp_path / "requester")
    assert again.providers == ["spare", "p1", "p2"] and again.fingerprint == spec.fingerprint()
    late = Peer(id="late", address="127.0.0.1:9003")
    record.note(before.model_copy(update={"slots": 4, "peers": [*before.peers, late]}))
    assert record.providers == ["p0", "p1", "p2", "late"]  # a newcomer in a slot never filled: a position of its own


def test_a_record_an_older_meshlearn_wrote_after_a_replacement_is_refused_in_one_line(procs: Processes):
    folder = procs.folder / "task"
    folder.mkdir()
    request = TaskRequest(data_on_providers="digits", providers=3, min_providers=2)
    (folder / "task.json").write_text(json.dumps({  # every provider of the attempt, the lost one and its newcomer
        "task": "old1", "request": request.model_dump(mode="json"), "secret": "0" * 64, "status": "running",
        "providers": ["p0", "p1", "p2", "spare"], "fingerprint": "0" * 16}))
    with pytest.raises(CheckpointError, match="names 4 providers for a task of at most 3"):
        TaskRecord.read(folder)
    proc = procs.start("resume", "request", "--bootstrap", "127.0.0.1:1", "--resume", "old1", "--output", str(folder))
    assert proc.wait(timeout=60) == 2
    lines = procs.log("resume").strip().splitlines()
    assert "request the task afresh" in lines[-1] and not any("Traceback" in line for line in lines), lines


def _latest(folder) -> int:
    return CheckpointStore(folder / FOLDER).latest(POSITIONS) or 0


# slow (about 100 s: a provider lost and replaced, the task killed whole and resumed to its end); the default
# run keeps the positions' checkpoints and record above, and the replacement in test_network_join
@pytest.mark.slow
def test_a_task_that_took_in_a_replacement_resumes_on_it_not_on_the_provider_it_lost(procs):
    hold = Hold(procs.folder, KILL_AT, JOIN_AT, CUT_AT)
    bootstrap, ids = start_network(procs, 3, ttl=4.0, provider_args=("--models-module", MODELS),
                                   provider_env=hold.env)
    folder = procs.folder / "task"
    procs.start("cut", "request", "--bootstrap", bootstrap, "--output", str(folder), *TASK)
    hold.wait_held(procs, ids)
    spare = ["provider", "--bootstrap", bootstrap, "--id", "spare", "--host", "127.0.0.1", "--workdir",
             str(procs.folder / "spare"), "--models-module", MODELS]
    procs.start("spare", *spare)  # free, but the task has no free slot until it loses a provider
    procs.wait_for("spare", "registered with")
    procs.kill("p0")
    hold.release()
    procs.wait_for("cut", r"provider spare joined as provider 3 in place of p0 \(its shard\)", timeout=120)
    procs.wait_for("cut", r"spare: training")
    hold.release()
    hold.wait_held(procs, ["p1", "p2"])  # at cycle 30, the spare waiting for them in the next one
    assert wait_until(lambda: _latest(folder) >= CUT_CYCLE, timeout=60), procs.log("cut")  # every position's kept
    for name in ["cut", "p1", "p2", "spare"]:  # every process of the task, at once
        procs.kill(name)
    hold.release_all()
    assert json.loads((folder / "task.json").read_text())["providers"] == ["spare", "p1", "p2"]
    for name in ids:  # the lost one back too, free (and first in the bootstrap's own order)
        procs.start(f"{name}-again", "provider", "--bootstrap", bootstrap, "--id", name, "--host", "127.0.0.1",
                    "--workdir", str(procs.folder / name), "--models-module", MODELS)
    procs.start("spare-again", *spare)
    for name in [*ids, "spare"]:
        procs.wait_for(f"{name}-again", "registered with")
    task_id = json.loads((folder / "task.json").read_text())["task"]
    resumed = procs.start("resumed", "request", "--bootstrap", bootstrap, "--resume", task_id, "--output",
                          str(folder), "--models-module", MODELS)
    assert resumed.wait(timeout=300) == 0, procs.log("resumed")
    out = procs.log("resumed")
    assert f"checkpoints of cycle {CUT_CYCLE}" in out and f"task {task_id}: 3 provider(s): spare, p1, p2" in out, out
    metrics = json.loads((folder / "metrics.json").read_text())
    assert sorted(metrics["providers"]) == ["p1", "p2", "spare"] and metrics["lost"] == [], metrics
    assert metrics["accuracy"] > 0.8
    record = json.loads((folder / "task.json").read_text())
    assert record["providers"] == ["spare", "p1", "p2"] and record["status"] == "done"


def test_a_resume_may_send_at_another_udp_rate_but_not_train_otherwise(procs: Processes):
    """How fast a UDP task's providers send is not what it trains: --resume takes a new --udp-rate
    (then finds no checkpoint here, as it should), and still refuses a setting that changes training."""
    from meshlearn.network.task.state import secret_digest

    folder = procs.folder / "task"
    folder.mkdir()
    request = TaskRequest(data_on_providers="digits", providers=2, algorithm="dpsgd", transport="udp")
    (folder / "task.json").write_text(json.dumps({
        "task": "rate1", "request": request.model_dump(mode="json"), "secret": secret_digest(b"network-secret", "rate1"),
        "status": "running", "providers": ["p0", "p1"], "fingerprint": "0" * 16}))
    said = {}
    for name, flags in (("rate", ["--udp-rate", "5mbit"]), ("lr", ["--lr", "0.5"])):
        proc = procs.start(name, "request", "--bootstrap", "127.0.0.1:1", "--secret", "network-secret",
                           "--resume", "rate1", "--output", str(folder), *flags)
        assert proc.wait(timeout=60) != 0
        said[name] = procs.log(name).strip().splitlines()[-1]
    assert "has no checkpoint from every one of its providers" in said["rate"], said
    assert "these differ from them: lr" in said["lr"], said
