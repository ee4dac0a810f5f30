"""A network task whose every process died goes on from the checkpoints its providers sent the
requester (``meshlearn request --resume TASK_ID``), on its own providers once they came back."""

from __future__ import annotations

import json
import re

import pytest
from helpers.hold import MODELS, Hold
from helpers.netproc import Processes, start_network

from meshlearn.checkpoint import FOLDER, CheckpointStore

# mlp, held at a step while the test kills the task (helpers/hold.py)
TASK = ["--data", "digits", "--model", "held-mlp", "--models-module", MODELS, "--lr", "0.05", "--batch-size", "16",
        "--wait", "0"]
# mid-way through epoch 5 of 8 (30 batches of 16 an epoch on a third of digits' 1,438 training images): the
# providers have sent the checkpoints of cycles 1-4 (one an epoch) before they hold there
HOLD_AT = 4 * 30 + 15


def _checkpoints(folder, providers: int) -> int:
    return CheckpointStore(folder / FOLDER).latest([f"provider-{i}" for i in range(providers)]) or 0


def _restart_providers(procs: Processes, bootstrap: str, ids: list[str]) -> None:
    for pid in ids:
        procs.start(f"{pid}-again", "provider", "--bootstrap", bootstrap, "--id", pid, "--host", "127.0.0.1",
                    "--workdir", str(procs.folder / pid), "--models-module", MODELS)
    for pid in ids:
        procs.wait_for(f"{pid}-again", "registered with")


def _run_to_the_end(procs: Processes, name: str, *args: str) -> str:
    proc = procs.start(name, "request", *args)
    assert proc.wait(timeout=300) == 0, procs.log(name)
    return procs.log(name)


def _refuses_bad_resumes(procs: Processes, bootstrap: str, task_id: str, folder) -> None:
    """Another secret, changed settings, a damaged checkpoint: one line each, nothing overwritten."""
    record = (folder / "task.json").read_bytes()
    resume = ["request", "--bootstrap", bootstrap, "--resume", task_id, "--output", str(folder), "--models-module",
              MODELS]
    newest = CheckpointStore(folder / FOLDER).folder(_checkpoints(folder, 3))
    tensors = newest / "provider-1.safetensors"
    kept = tensors.read_bytes()
    for name, extra, secret, said in [
            ("secret", [], "another-secret", "ran on a network with another secret"),
            ("changed", ["--lr", "0.2"], None, "these differ from them: lr"),
            ("damaged", [], None, "provider-1.safetensors does not match its checksum")]:
        if name == "damaged":
            tensors.write_bytes(kept[:-1] + bytes([kept[-1] ^ 0xFF]))
        proc = procs.start(f"bad-{name}", *resume, *extra, **({"secret": secret} if secret else {}))
        assert proc.wait(timeout=60) == 2, (name, procs.log(f"bad-{name}"))
        lines = procs.log(f"bad-{name}").strip().splitlines()
        assert said in lines[-1] and not any("Traceback" in line for line in lines), lines
    tensors.write_bytes(kept)
    assert (folder / "task.json").read_bytes() == record


# slow (about 70 s: the task runs whole, then cut and resumed): the default run keeps the resume's rules below
# (only the claiming key claims a task again, never a done one; the requester keeps only whole checkpoints)
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedavg"])
def test_a_task_killed_whole_mid_training_resumes_from_its_last_checkpoint(procs, algorithm):
    hold = Hold(procs.folder, HOLD_AT, armed=False)  # the whole run trains straight through
    bootstrap, ids = start_network(procs, 3, ttl=4.0, provider_args=("--models-module", MODELS),
                                   provider_env=hold.env)
    task = [*TASK, "--algorithm", algorithm, "--epochs", "8", "--providers", "3"]
    whole = _run_to_the_end(procs, "whole", "--bootstrap", bootstrap, "--output", str(procs.folder / "whole"), *task)
    folder = procs.folder / "cut"
    hold.arm()
    procs.start("cut", "request", "--bootstrap", bootstrap, "--output", str(folder), *task)
    hold.wait_held(procs, ids)  # each has sent its checkpoints of cycles 1-4, and waits in cycle 5
    at = _checkpoints(folder, 3)
    assert at >= 4, procs.log("cut")
    for name in ["cut", *ids]:  # every process of the task, at once
        procs.kill(name)
    hold.release()  # the resumed run trains straight through
    task_id = json.loads((folder / "task.json").read_text())["task"]
    assert not (folder / "metrics.json").exists()
    _refuses_bad_resumes(procs, bootstrap, task_id, folder)
    _restart_providers(procs, bootstrap, ids)
    out = _run_to_the_end(procs, "resumed", "--bootstrap", bootstrap, "--resume", task_id, "--output", str(folder),
                          "--models-module", MODELS)
    assert int(re.search(r"checkpoints of cycle (\d+)", out).group(1)) == at  # the newest, kept before the kill
    first, second = (json.loads((procs.folder / run / "metrics.json").read_text()) for run in ("whole", "cut"))
    assert abs(first["accuracy"] - second["accuracy"]) <= 0.02, (first["accuracy"], second["accuracy"])
    assert sorted(second["providers"]) == ids  # its own providers, back
    assert json.loads((folder / "task.json").read_text())["status"] == "done"
    assert not (folder / FOLDER).exists()  # a task that is done is never resumed: its checkpoints went
    again = procs.start("again", "request", "--bootstrap", bootstrap, "--resume", task_id, "--output", str(folder),
                        "--models-module", MODELS)
    assert again.wait(timeout=60) == 2 and f"task {task_id} is done" in procs.log("again")
    assert "done" in whole


def test_the_bootstrap_lets_only_the_claiming_key_claim_a_task_again_and_never_a_done_one(tmp_path):
    from meshlearn.errors import BadMessage
    from meshlearn.network.bootstrap.registry import ProviderInfo, Registry

    reg = Registry(tmp_path / "r.sqlite").open()
    for i in range(4):
        reg.register(ProviderInfo(f"p{i}", f"127.0.0.1:{9000 + i}", 8.0, 2, "cpu", ""))
    assert len(reg.claim("t1", "req", 2, requester_key="mine")) == 2
    with pytest.raises(BadMessage, match="claimed by another key"):
        reg.claim("t1", "req", 2, requester_key="theirs")
    again = reg.claim("t1", "req", 2, requester_key="mine")  # resumed: its providers of then were lost to it
    assert len(again) == 2 and {p["id"] for p in reg.task("t1")["providers"]} == {p.id for p in again}
    reg.release("t1", "done")
    with pytest.raises(BadMessage, match="is done"):
        reg.claim("t1", "req", 1, requester_key="mine")
    reg.close()


def test_the_requester_keeps_a_checkpoint_only_whole_of_its_task_and_from_the_provider_it_names(tmp_path):
    from meshlearn.checkpoint import RunCheckpoints
    from meshlearn.network.channel.envelope import BadMessage
    from meshlearn.network.task.spec import TaskSpec
    from meshlearn.network.task.state import KeptCheckpoints, checkpoint_name

    spec = TaskSpec(task_id="t1", model="mlp", epochs=2, batch_size=8, lr=0.1, algorithm="leader",
                    aggregate_every="epoch", seed=1, partition="iid", eval_samples=0, peer_timeout=5,
                    peers=[{"id": "a", "address": "127.0.0.1:1"}, {"id": "b", "address": "127.0.0.1:2"}],
                    data={"mode": "local", "dataset": "digits"})
    sent = RunCheckpoints(tmp_path / "provider", checkpoint_name(1), spec.fingerprint())
    import torch

    sent.save(3, {"model": {"w": torch.ones(4)}})
    folder = sent.store.folder(3)
    files = [(folder / f"provider-1{suffix}").read_bytes() for suffix in (".json", ".safetensors")]
    kept = KeptCheckpoints(tmp_path / "requester")
    callers = []

    def only_provider_1(sender, index):
        callers.append(index)
        if sender != "b" or index != 1:
            raise BadMessage("this key is not provider 1")

    def send(body, blobs, sender="b", running=spec):
        sent = {"task": "t1", "index": 1, "cycle": 3, **body}
        return kept.take(running, sent["task"], sent["index"], sent["cycle"], *blobs,
                         lambda index: only_provider_1(sender, index))

    with pytest.raises(BadMessage, match="not provider 1"):
        send({}, files, sender="a")  # another provider's key naming provider 1
    with pytest.raises(BadMessage, match="does not match its checksum"):
        send({}, [files[0], files[1][:-1] + bytes([files[1][-1] ^ 1])])
    with pytest.raises(BadMessage, match="says it is of iteration 3, not 4"):
        send({"cycle": 4}, files)
    with pytest.raises(BadMessage, match="runs task t1, not that one"):
        send({"task": "t2"}, files)
    with pytest.raises(BadMessage, match="has no provider 5"):
        send({"index": 5}, files)
    other = spec.model_copy(update={"lr": 0.2})  # another training: another fingerprint
    with pytest.raises(BadMessage, match="of another training"):
        send({}, files, running=other)
    assert kept.store.iterations() == []  # nothing kept of any of those
    assert send({}, files) == 3
    assert kept.store.has(3, "provider-1") and kept.latest(2) is None  # provider 0 sent none yet
