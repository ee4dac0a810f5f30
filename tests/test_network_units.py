"""The network services' pieces in one process: signed messages, RPC robustness, registry, data transfer, rules."""

from __future__ import annotations

import threading

import pytest
import zmq
from helpers.netproc import running_in_thread
from helpers.waiting import wait_until

from meshlearn.clock import FakeClock
from meshlearn.errors import UserInputError
from meshlearn.network.bootstrap.registry import ProviderInfo
from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings
from meshlearn.network.channel.envelope import (
    AuthError,
    BadMessage,
    Envelope,
    NetworkError,
    resolve_secret,
    seal,
    unseal,
)
from meshlearn.network.channel.rpc import RemoteError, RpcServer, call, parse_address
from meshlearn.network.provider.taskdata import chunk_source
from meshlearn.network.task.access import TaskAccess
from meshlearn.network.task.datashare import FileShare, check_name, download
from meshlearn.network.task.spec import TaskSpec, dataset_spec, validate_request

SECRET = b"unit-test-secret"


# ---- signed envelopes --------------------------------------------------------------------

def test_envelope_round_trip_keeps_body_and_blobs():
    frames = seal(Envelope("x", {"a": [1, 2], "b": "c"}, [b"\x00" * 10, bytearray(b"xyz")], "me"), SECRET)
    got = unseal(frames, SECRET, 1 << 20)
    assert (got.kind, got.body, got.sender) == ("x", {"a": [1, 2], "b": "c"}, "me")
    assert [bytes(b) for b in got.blobs] == [b"\x00" * 10, b"xyz"]


@pytest.mark.parametrize("mutate, error, text", [
    (lambda f: f, AuthError, "secret"),  # checked with another secret below
    (lambda f: [f[0], b"tampered", f[2]], AuthError, "secret"),
    (lambda f: f[:1], BadMessage, "header and a signature"),
])
def test_unseal_rejects_foreign_tampered_and_truncated(mutate, error, text):
    frames = mutate(seal(Envelope("x", {}, [b"blob"]), SECRET))
    with pytest.raises(error, match=text):
        unseal(frames, SECRET if error is not AuthError or len(frames) != 3 or frames[1] == b"tampered"
               else b"another-secret", 1 << 20)


def _dealer_of_this_version() -> zmq.Socket:
    """A raw DEALER socket that states this release's protocol version at its handshake, as every
    client does (``channel.handshake``): what it sends then reaches the checks after the version's."""
    from meshlearn.network.channel.handshake import PROTOCOL_VERSION, properties

    sock = zmq.Context.instance().socket(zmq.DEALER)
    for prop in properties(PROTOCOL_VERSION):
        sock.setsockopt(zmq.METADATA, prop)
    return sock


def test_unseal_rejects_oversized_bad_json_and_wrong_version():
    with pytest.raises(BadMessage, match="cap"):
        unseal(seal(Envelope("x", {}, [b"\x00" * 5000]), SECRET), SECRET, 1000)
    import hashlib
    import hmac

    def signed(header: bytes):
        mac = hmac.new(SECRET, digestmod=hashlib.sha256)
        mac.update(len(header).to_bytes(8, "little"))
        mac.update(header)
        return [header, mac.digest()]
    with pytest.raises(BadMessage, match="JSON"):
        unseal(signed(b"\xff{not json"), SECRET, 1 << 20)
    with pytest.raises(BadMessage, match="version"):
        unseal(signed(b'{"v": 99}'), SECRET, 1 << 20)
    with pytest.raises(BadMessage, match="lacks"):
        unseal(signed(b'{"v": 1, "kind": 3}'), SECRET, 1 << 20)


def test_secret_must_be_given_and_long_enough(monkeypatch):
    monkeypatch.delenv("MESHLEARN_SECRET", raising=False)
    with pytest.raises(UserInputError, match="no network secret"):
        resolve_secret()
    with pytest.raises(UserInputError, match="too short"):
        resolve_secret("short")
    monkeypatch.setenv("MESHLEARN_SECRET", "from-the-environment")
    assert resolve_secret() == b"from-the-environment"


# ---- RPC server robustness ----------------------------------------------------------------

@pytest.fixture
def echo_server():
    server = RpcServer("echo", "127.0.0.1", 0, SECRET, {"echo": lambda req: (req.body, req.blobs)},
                       max_bytes=64 * 1024)
    server.start()
    yield server
    server.stop()


def test_wrong_secret_is_refused_both_ways(echo_server):
    with pytest.raises(AuthError, match="different secret"):
        call(echo_server.address, "echo", {}, b"not-the-secret", timeout=5)
    assert echo_server.rejected == 1
    assert call(echo_server.address, "echo", {"k": 1}, SECRET, timeout=5).body == {"k": 1}


def test_garbage_and_oversized_messages_do_not_crash_the_server(echo_server):
    sock = _dealer_of_this_version()
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{echo_server.address}")
    try:
        sock.send_multipart([b"garbage"])
        sock.send_multipart([b"{}", b"x" * 32])
        assert wait_until(lambda: echo_server.rejected == 2, timeout=10)
        sock.send_multipart([b"\x00" * (128 * 1024)])  # over the socket's size cap: the peer is dropped
    finally:
        sock.close(0)
    with pytest.raises(RemoteError, match="cap"):
        call(echo_server.address, "echo", {}, SECRET, blobs=[b"\x00" * 40_000, b"\x00" * 40_000], timeout=5)
    with pytest.raises(RemoteError, match="does not serve"):
        call(echo_server.address, "nope", {}, SECRET, timeout=5)
    assert call(echo_server.address, "echo", {"still": "alive"}, SECRET, timeout=5).body == {"still": "alive"}
    assert echo_server.rejected == 4


def test_a_replayed_request_is_refused_and_a_nan_timestamp_is_outside_the_window(echo_server):
    """A captured request sent again (a claim, a leave, a results fetch) must not act twice."""
    captured = seal(Envelope("echo", {"n": 1}, sender="someone"), SECRET)
    sock = _dealer_of_this_version()
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{echo_server.address}")
    try:
        replies = []
        for _ in range(2):
            sock.send_multipart(captured)
            assert sock.poll(5000), "no reply"
            replies.append(unseal(sock.recv_multipart(), SECRET, 1 << 20))
    finally:
        sock.close(0)
    assert replies[0].kind == "ok" and replies[0].body == {"n": 1}
    assert replies[1].kind == "error" and "replay" in replies[1].body["error"]
    with pytest.raises(BadMessage, match="timestamp"):
        unseal(seal(Envelope("echo", {}, sent_at=float("nan")), SECRET), SECRET, 1 << 20)


def test_engine_messages_are_sealed_for_one_task_only_and_every_chunk_is_checked():
    import torch

    from meshlearn.errors import WireError
    from meshlearn.wire import Kind, Message
    from meshlearn.wire.sealed import CHUNK, FrameSeal, decode_for, encode_for

    first, second = FrameSeal(FrameSeal.new_key()), FrameSeal(FrameSeal.new_key())
    weights = torch.randn(3 * CHUNK // 4 + 5)  # three chunks, the last one short
    msg = Message(Kind.MODEL, 1, 7, 2, {"w": weights, "empty": torch.zeros(0)}, {"loss": 0.5})
    frames = [bytes(memoryview(f)) for f in encode_for(msg, None, first)]
    assert weights.numpy().tobytes()[:64] not in b"".join(frames)  # no plaintext
    got = decode_for(frames, 1 << 30, None, first)
    assert torch.equal(got.tensors["w"], weights) and got.tensors["empty"].numel() == 0 and got.meta == {"loss": 0.5}
    with pytest.raises(WireError, match="not sealed with this task's key"):  # captured in one task, replayed in another
        decode_for(frames, 1 << 30, None, second)
    flipped = bytearray(frames[2])
    flipped[100] ^= 1
    for bad, text in [(frames[:2] + [bytes(flipped)] + frames[3:], "not sealed"),
                      (frames[:2] + frames[3:4] + frames[2:3] + frames[4:], "not sealed"),  # chunks swapped
                      (frames[:-1], "wrong number of chunks"),
                      ([frames[0][:10]], "truncated"),
                      ([b"XXXX" + frames[0][4:], *frames[1:]], "bad magic")]:
        with pytest.raises(WireError, match=text):
            decode_for(bad, 1 << 30, None, first)
    with pytest.raises(WireError, match="size cap"):
        decode_for(frames, 1000, None, first)


def test_parse_address_refuses_bad_ports():
    assert parse_address("127.0.0.1:8080") == "127.0.0.1:8080"
    for bad, text in [("127.0.0.1:0", "outside"), ("h:70000", "outside"), ("h:http", "not a number"), ("h", "HOST:PORT")]:
        with pytest.raises(UserInputError, match=text):
            parse_address(bad)


# ---- registry and bootstrap -------------------------------------------------------------

def _provider(i: int, device: str = "cpu", location: str = "") -> ProviderInfo:
    return ProviderInfo(f"p{i}", f"127.0.0.1:{9000 + i}", 8.0, 2 + i, device, location)


def test_a_learning_rate_outside_the_sane_range_is_kept_with_a_warning():
    for lr, consequence in [(100, "diverge"), (1e-8, "barely move")]:
        request = validate_request({"data": "digits", "lr": lr})
        assert request.lr == lr and len(request.warnings) == 1
        assert "outside [1e-06, 10]" in request.warnings[0] and consequence in request.warnings[0]
    assert validate_request({"data": "digits", "lr": 0.05}).warnings == []


def test_the_memory_estimate_counts_model_optimizer_activations_and_data():
    from meshlearn.models import build_model
    from meshlearn.network.task.resources import GB, RUNTIME_BYTES, estimate_memory

    model = build_model("mlp", (1, 8, 8), 10)
    params = sum(p.numel() * 4 for p in model.parameters())
    plain = estimate_memory(model, (1, 8, 8), 16, 100, 50, momentum=0.0)
    moving = estimate_memory(model, (1, 8, 8), 32, 200, 50, momentum=0.9)
    assert plain.runtime == RUNTIME_BYTES and plain.model == 4 * params and moving.model == 5 * params
    from meshlearn.outer import OuterOptimizer

    adam = estimate_memory(model, (1, 8, 8), 16, 100, 50, momentum=0.0,
                           outer_copies=OuterOptimizer.model_validate("adam").copies)
    assert adam.model == plain.model + 5 * params  # the model before the round, Adam's moments, two buffers
    assert moving.activations == 2 * plain.activations > 0  # twice the batch
    assert plain.data == (4 * 64 + 8) * 150 and moving.data == (4 * 64 + 8) * 250
    assert plain.total == plain.runtime + plain.model + plain.activations + plain.data
    assert plain.describe().startswith(f"about {plain.total / GB:.2f} GB (runtime 0.30")
    gpt = build_model("gpt-tiny", (64,), 256)  # 4 layers of 4 heads: each keeps its attention weights, T x T
    text = estimate_memory(gpt, (64,), 8, 100, 10, momentum=0.0, tokens=True)
    assert text.activations >= 2 * 8 * 4 * 4 * 64 * 64 * 4 and text.data == 2 * 64 * 110


def test_a_provider_declaring_more_than_the_machine_has_is_refused_and_too_little_warned(tmp_path):
    from meshlearn.network.task.resources import check_declared, machine_cores, machine_ram_gb

    with pytest.raises(UserInputError, match="more than this machine has"):
        check_declared(machine_ram_gb() + 1, None, tmp_path)
    with pytest.raises(UserInputError, match="more than this machine has"):
        check_declared(None, machine_cores() + 1, tmp_path)
    warnings = check_declared(0.5, 1, tmp_path / "not-made-yet")
    assert len(warnings) == 2 and "2 GB minimum for ML" in warnings[0] and "share one core" in warnings[1]


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def bootstrap(tmp_path, clock):
    service = Bootstrap(BootstrapSettings(host="127.0.0.1", port=0, state=str(tmp_path / "b.sqlite"), ttl=1.0,
                                          dial_back=False), SECRET,
                        clock=clock)
    with running_in_thread(service):
        yield service


def _register(address: str, i: int) -> None:
    p = _provider(i)
    call(address, "register", {"id": p.id, "address": p.address, "ram_gb": p.ram_gb, "cores": p.cores,
                               "device": p.device, "location": p.location}, SECRET, timeout=5)


def test_heartbeats_keep_providers_and_silence_expires_them(bootstrap, clock):
    address = bootstrap.server.address
    _register(address, 0)
    _register(address, 1)

    def listed():
        return sorted(p["id"] for p in call(address, "discover", {"count": 10}, SECRET, timeout=5).body["providers"])
    clock.advance(0.6)
    assert call(address, "heartbeat", {"id": "p0", "status": "free"}, SECRET, timeout=5).body["known"]
    assert listed() == ["p0", "p1"]  # the TTL (1 s) has not passed for anyone
    clock.advance(0.6)  # p1 silent for 1.2 s, p0 for 0.6 s: the next sweep drops p1 only
    assert wait_until(lambda: listed() == ["p0"], timeout=10)
    assert call(address, "heartbeat", {"id": "p1", "status": "free"}, SECRET, timeout=5).body["known"] is False


def test_bootstrap_refuses_malformed_requests_and_keeps_serving(bootstrap):
    address = bootstrap.server.address
    for body, text in [({"id": "p0"}, "register: field 'address': Field required"),
                       ({"id": "p0", "address": "a", "ram_gb": "lots", "cores": 2, "device": "cpu"},
                        "register: field 'ram_gb': Input should be a valid number"),
                       ({"id": "p0", "address": "a", "ram_gb": 1, "cores": 2, "device": "tpu"},
                        "register: field 'device': Input should be 'cuda', 'mps' or 'cpu'")]:
        with pytest.raises(RemoteError, match=text):
            call(address, "register", body, SECRET, timeout=5)
    with pytest.raises(RemoteError, match="no free provider"):
        call(address, "claim", {"task": "t1", "count": 2}, SECRET, timeout=5)
    _register(address, 0)
    assert [p["id"] for p in call(address, "claim", {"task": "t1", "count": 2}, SECRET, timeout=5).body["providers"]] == ["p0"]


# ---- data transfer -----------------------------------------------------------------------

def _share_handlers(share: FileShare, tmp_path) -> dict:
    """The dispatch table of a requester's data server that serves ``share`` (its typed handlers;
    the requester is built, never run: its bootstrap is nowhere)."""
    from meshlearn.network.requester.service import Requester
    from meshlearn.network.task.spec import TaskRequest

    requester = Requester(TaskRequest(data_on_providers="digits", providers=1), "127.0.0.1:9", SECRET,
                          tmp_path / "requester", say=lambda _: None)
    return requester.handlers(share)


def test_download_resumes_after_the_server_drops_and_checks_names(tmp_path):
    source = tmp_path / "shard-0.safetensors"
    payload = bytes(range(256)) * 4096 * 3  # 3 MiB: 12 chunks of 256 KiB
    source.write_bytes(payload)
    share = FileShare()
    share.add(source.name, source)
    handlers = _share_handlers(share, tmp_path)
    served = []

    def flaky(req):
        if len(served) == 5:  # the connection drops after five chunks
            raise NetworkError("connection dropped")
        served.append(req.body["offset"])
        return handlers["data.chunk"](req)
    server = RpcServer("share", "127.0.0.1", 0, SECRET, {"data.chunk": flaky})
    server.start()
    try:
        with pytest.raises(NetworkError, match="failed at byte 1310720"):
            download(chunk_source(server.address, SECRET, ""), source.name, share.manifest()[source.name],
                     tmp_path / "dest", source=server.address, retries=0, chunk_bytes=256 * 1024)
        assert (tmp_path / "dest" / f"{source.name}.part").stat().st_size == 5 * 256 * 1024
        server.handlers["data.chunk"] = lambda req: (served.append(req.body["offset"]), handlers["data.chunk"](req))[1]
        got = download(chunk_source(server.address, SECRET, ""), source.name, share.manifest()[source.name],
                       tmp_path / "dest", chunk_bytes=256 * 1024)
        assert got.read_bytes() == payload
        assert served == [i * 256 * 1024 for i in range(12)]  # nothing fetched twice
        with pytest.raises(RemoteError, match="not allowed"):
            call(server.address, "data.chunk", {"name": "../../etc/passwd", "offset": 0}, SECRET, timeout=5)
        with pytest.raises(RemoteError, match="no shared file"):
            call(server.address, "data.chunk", {"name": "other.bin", "offset": 0}, SECRET, timeout=5)
    finally:
        server.stop()
    for bad in ["../x", "/etc/passwd", ".hidden", "a/b", "a..b"]:
        with pytest.raises(BadMessage):
            check_name(bad)


def test_download_deletes_a_file_whose_hash_does_not_match(tmp_path):
    source = tmp_path / "f.bin"
    source.write_bytes(b"abc" * 1000)
    share = FileShare()
    share.add("f.bin", source)
    server = RpcServer("share", "127.0.0.1", 0, SECRET, _share_handlers(share, tmp_path))
    server.start()
    try:
        with pytest.raises(NetworkError, match="SHA-256"):
            download(chunk_source(server.address, SECRET, ""), "f.bin", {"size": 3000, "sha256": "0" * 64}, tmp_path / "d")
        assert not (tmp_path / "d" / "f.bin.part").exists() and not (tmp_path / "d" / "f.bin").exists()
    finally:
        server.stop()


def test_a_download_stops_when_its_task_is_cancelled_and_a_vanished_file_is_a_clear_error(tmp_path):
    source = tmp_path / "f.bin"
    source.write_bytes(bytes(range(256)) * 4096)  # 1 MiB: 4 chunks of 256 KiB
    share = FileShare()
    share.add("f.bin", source)
    server = RpcServer("share", "127.0.0.1", 0, SECRET, _share_handlers(share, tmp_path))
    server.start()
    asked = []

    class Cancelled(Exception):
        pass

    def cancel_after_two():
        if len(asked) == 2:
            raise Cancelled
        asked.append(1)
    try:
        with pytest.raises(Cancelled):
            download(chunk_source(server.address, SECRET, ""), "f.bin", share.manifest()["f.bin"], tmp_path / "d",
                     chunk_bytes=256 * 1024, before_chunk=cancel_after_two)
        assert share.chunks_served == 2  # no request after the cancel
        assert (tmp_path / "d" / "f.bin.part").stat().st_size == 2 * 256 * 1024  # kept for a resume
        source.unlink()  # the requester's file goes away while it is being served
        for _ in range(2):  # an error reply each time: the service stays up
            with pytest.raises(RemoteError, match="'f.bin' can no longer be read"):
                call(server.address, "data.chunk", {"name": "f.bin", "offset": 0}, SECRET, timeout=5)
    finally:
        server.stop()


# ---- request validation rules ------------------------------------------------------------

def test_request_rules_correct_what_they_can_and_warn():
    req = validate_request({"data": "digits", "batch_size": 0, "lr": -1, "epochs": 2.6}, train_samples=1000)
    assert (req.batch_size, req.lr, req.epochs) == (16, 0.001, 3)
    assert len(req.warnings) == 3
    assert validate_request({"data": "digits", "batch_size": 5000}, 1000).batch_size == 16
    assert validate_request({"data": "digits", "epochs": 1e9}).epochs == 1000
    assert validate_request({"data": "digits", "epochs": 0.2}).epochs == 1
    ok = validate_request({"data": "digits", "batch_size": 32, "lr": 0.1, "epochs": 4}, 1000)
    assert (ok.batch_size, ok.lr, ok.epochs, ok.warnings) == (32, 0.1, 4, [])
    for values, text in [({}, "no data"), ({"data": "digits", "algorithm": "magic"}, "algorithm"),
                         ({"data": "digits", "epochs": "many"}, "not a number"),
                         ({"data": "digits", "providers": 0}, "at least 1"),
                         ({"data": "digits", "momentum": 1.5}, "momentum"),
                         ({"data": "digits", "aggregate_every": "sometimes"}, "aggregate-every")]:
        with pytest.raises(UserInputError, match=text):
            validate_request(values)


def test_data_path_must_hold_train_and_test(tmp_path):
    assert dataset_spec("digits") == "digits"
    with pytest.raises(UserInputError, match="does not exist"):
        dataset_spec(str(tmp_path / "missing"))
    (tmp_path / "train").mkdir()
    with pytest.raises(UserInputError, match="no train/ and test/"):
        dataset_spec(str(tmp_path))
    (tmp_path / "test").mkdir()
    assert dataset_spec(str(tmp_path)) == f"imagefolder:{tmp_path.resolve()}"


def test_task_spec_from_the_network_is_validated():
    with pytest.raises(BadMessage, match="task_id"):
        TaskSpec.parse({"task_id": "../x"})
    with pytest.raises(BadMessage, match="task spec"):
        TaskSpec.parse({"task_id": "t1", "model": "mlp", "epochs": -1})


# ---- provider-side rules -----------------------------------------------------------------

def test_a_device_that_does_not_work_falls_back_to_the_cpu():
    import torch

    from meshlearn.network.provider.service import detect_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a working CUDA device")
    device, warning = detect_device("cuda")
    assert device == "cpu" and "does not work here" in warning and "CPU" in warning
    assert detect_device("cpu") == ("cpu", None)


def test_custom_models_come_only_from_a_local_module_the_operator_names(tmp_path):
    from meshlearn.models import build_model
    from meshlearn.plugins import load_user_module

    module = tmp_path / "my_models.py"
    module.write_text(
        "from torch import nn\n"
        "from meshlearn.models.registry import register_model\n"
        "@register_model('tiny-operator-model')\n"
        "def tiny(shape, classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(shape[0] * shape[1] * shape[2], classes))\n")
    load_user_module(str(module))
    assert build_model("tiny-operator-model", (1, 8, 8), 10)[1].out_features == 10
    with pytest.raises(UserInputError, match="does not exist"):
        load_user_module(str(tmp_path / "missing.py"))


def test_local_data_must_lie_under_the_providers_data_root(tmp_path):
    from meshlearn.network.provider.taskdata import allowed_local
    from meshlearn.network.provider.taskrun import ProviderContext, TaskRun

    spec = TaskSpec(task_id="t1", model="mlp", epochs=1, batch_size=16, lr=0.1, algorithm="leader",
                    aggregate_every="epoch", seed=1, partition="iid", eval_samples=0, peer_timeout=5,
                    peers=[{"id": "p0", "address": "127.0.0.1:1"}], data={"mode": "local", "dataset": "digits"})
    root = tmp_path / "root"
    (root / "cifar").mkdir(parents=True)
    assert allowed_local("digits", root) == "digits"
    assert allowed_local("cifar10:cifar", root) == f"cifar10:{(root / 'cifar').resolve()}"
    for escape in ["imagefolder:../../etc", "imagefolder:/etc"]:
        with pytest.raises(BadMessage, match="outside"):
            allowed_local(escape, root)
    with pytest.raises(BadMessage, match="--data-root"):
        allowed_local("cifar10:cifar", None)
    with pytest.raises(BadMessage, match="does not list this provider"):
        TaskRun(spec, ProviderContext("stranger", "127.0.0.1", SECRET, tmp_path / "work"), bytes(32),
                TaskAccess.of(spec, ""))


def test_a_finished_task_run_lets_go_of_its_model_and_data(tmp_path):
    """Providers used to keep every task run's model, data and buffers for good (11 MB per digits task)."""
    import gc
    import weakref

    from meshlearn.network.provider.taskrun import ProviderContext, RunState, TaskRun
    from meshlearn.network.task.results import read_results

    spec = TaskSpec(task_id="t1", model="mlp", epochs=1, batch_size=16, lr=0.1, algorithm="leader",
                    aggregate_every="epoch", seed=1, partition="iid", eval_samples=0, peer_timeout=5,
                    peers=[{"id": "p0", "address": "127.0.0.1:1"}], data={"mode": "local", "dataset": "digits"})
    run = TaskRun(spec, ProviderContext("p0", "127.0.0.1", SECRET, tmp_path / "work"), bytes(32), TaskAccess.of(spec, ""))
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    assert wait_until(lambda: run.state is not RunState.PREPARING, timeout=60)
    assert run.state is RunState.READY, run.error
    model = weakref.ref(run.node.model)
    run.start({})
    thread.join(timeout=120)
    assert run.state is RunState.DONE, run.error
    assert run.node is None and run.finisher.node is None and run.finisher.book is None
    gc.collect()
    assert model() is None  # nothing else holds it
    assert read_results(tmp_path / "work" / "tasks" / "t1" / "result") is not None  # what `results` serves


def test_a_runs_status_fits_its_declared_reply_with_no_engine_yet_and_a_long_error(tmp_path):
    """task.status answers a RunStatus: a run not bound yet has no engine (""), and a failure's error,
    however long, is cut to what the reply carries (else the requester never learns why it failed)."""
    from meshlearn.network.protocol.providerapi import MAX_ERROR, RunStatus
    from meshlearn.network.provider.taskrun import ProviderContext, TaskRun

    spec = TaskSpec(task_id="t1", model="mlp", epochs=1, batch_size=16, lr=0.1, algorithm="leader",
                    aggregate_every="epoch", seed=1, partition="iid", eval_samples=0, peer_timeout=5,
                    peers=[{"id": "p0", "address": "127.0.0.1:1"}], data={"mode": "local", "dataset": "digits"})
    run = TaskRun(spec, ProviderContext("p0", "127.0.0.1", SECRET, tmp_path / "work"), bytes(32), TaskAccess.of(spec, ""))
    assert run.status().engine == "" and run.status(leaving=True).leaving
    run.error = "RuntimeError: " + "x" * 5000
    status = RunStatus.read(run.status().body(), "task.status")
    assert status.error == run.error[:MAX_ERROR] and status.state == "preparing"


def test_a_provider_without_the_result_copy_gets_it_from_a_next_leader_that_already_finished(tmp_path):
    """The leader died after copying the result to some providers only; one without the copy pushed
    its final model to the next leader, which had finished its own run: it used to accept the push,
    never publish, and leave that provider busy (and deaf to SIGTERM) for good."""
    import socket
    import types

    import torch
    from safetensors.torch import save as save_safetensors
    from torch import nn

    from meshlearn.flat import FlatState
    from meshlearn.network.protocol import rpcs
    from meshlearn.network.protocol.providerapi import ResultMetrics
    from meshlearn.network.protocol.rpcs import Server
    from meshlearn.network.protocol.serving import serve
    from meshlearn.network.provider.finish import Finisher
    from meshlearn.network.provider.taskrun import ProviderContext
    from meshlearn.network.task.results import read_results

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # the first leader: gone
    servers = {i: RpcServer(f"p{i}", "127.0.0.1", 0, SECRET, {}) for i in (1, 2)}
    for server in servers.values():
        server.bind()
    peers = [{"id": "p0", "address": f"127.0.0.1:{dead}"}] + \
        [{"id": f"p{i}", "address": servers[i].address} for i in (1, 2)]
    spec = TaskSpec(task_id="t9", model="mlp", epochs=1, batch_size=16, lr=0.1, algorithm="leader",
                    aggregate_every="epoch", seed=1, partition="iid", eval_samples=0, peer_timeout=2,
                    peers=peers, data={"mode": "local", "dataset": "digits"})
    finishers = {i: Finisher(spec, ProviderContext(f"p{i}", "127.0.0.1", SECRET, tmp_path / f"w{i}"), i) for i in (1, 2)}

    def results_of(workdir):
        """``task.results`` as a provider serves it: the result it kept on disk."""
        def results(message, req):
            metrics, model, _ = read_results(workdir / "tasks" / message.task / "result")
            return ResultMetrics(metrics=metrics), [model]
        return results
    for i, server in servers.items():
        handlers = {rpcs.AGG_PUSH: finishers[i].on_push, rpcs.AGG_PING: finishers[i].on_ping,
                    rpcs.AGG_RESULTS: finishers[i].on_results, rpcs.TASK_RESULTS: results_of(tmp_path / f"w{i}")}
        server.handlers.update(serve(Server.PROVIDER, handlers, declared=tuple(handlers)))
        server.start()
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        result_model = save_safetensors({k: v.detach().clone() for k, v in model.state_dict().items()})
        finishers[1].result.keep({"task": "t9", "accuracy": 0.5}, result_model)  # p1 got the copy, then ended
        finishers[1].release()
        follower = finishers[2]
        follower.attach(types.SimpleNamespace(flat=FlatState(nn.Linear(4, 2)), model=nn.Linear(4, 2)), samples=10)
        done = threading.Thread(target=follower.finish, args=(3, lambda: None), daemon=True)
        done.start()
        done.join(timeout=60)
        assert not done.is_alive(), "the provider without the copy is stuck finishing"
        metrics, _, _ = read_results(tmp_path / "w2" / "tasks" / "t9" / "result")
        assert metrics == {"task": "t9", "accuracy": 0.5}
    finally:
        for server in servers.values():
            server.stop()


def test_refusals_are_logged_with_their_address_and_not_once_each(echo_server, caplog):
    import logging

    sock = _dealer_of_this_version()
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{echo_server.address}")
    try:
        with caplog.at_level(logging.WARNING, logger="meshlearn.network.channel.rpc"):
            for _ in range(10):
                sock.send_multipart(seal(Envelope("echo", {}), b"another-secret"))
            assert wait_until(lambda: echo_server.rejected == 10, timeout=10)
    finally:
        sock.close(0)
    lines = [r.getMessage() for r in caplog.records if "rejected a request" in r.getMessage()]
    assert len(lines) == 4 and all("from 127.0.0.1" in line for line in lines)  # the 1st, 2nd, 4th and 8th


def test_the_confusion_plot_names_its_task_and_labels_every_axis(tmp_path):
    import matplotlib.pyplot as plt

    from meshlearn.network.task import results

    fig = results.confusion_figure([[5, 1], [0, 4]], ["cat", "dog"], "task t7")
    try:
        ax, bar = fig.axes
        assert fig._suptitle.get_text() == "task t7"
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("predicted class", "true class")
        assert bar.get_ylabel() == "test samples"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["cat", "dog"]
    finally:
        plt.close(fig)
    results.write_results(tmp_path / "t7", {"confusion": [[5, 1], [0, 4]], "accuracy": 0.9}, b"model")
    assert (tmp_path / "t7" / results.CONFUSION_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results.read_results(tmp_path / "t7") == ({"confusion": [[5, 1], [0, 4]], "accuracy": 0.9}, b"model", None)


def test_a_task_shares_its_machines_cores_among_its_providers_there(tmp_path):
    """Two providers of one task on 2 cores with 2 torch threads each starved one another (the
    follower trained at a fifth of the leader's pace): a part trains with the declared cores
    divided among the task's providers that announce the same host (issue 33 item 6)."""
    from meshlearn.network.provider.taskrun import ProviderContext, TaskRun

    key = "A" * 43
    peers = [{"id": "p0", "address": f"10.0.0.1:9000@{key}"}, {"id": "p1", "address": f"10.0.0.1:9001@{key}"},
             {"id": "p2", "address": f"10.0.0.2:9000@{key}"}]
    spec = TaskSpec(task_id="t1", model="mlp", epochs=1, batch_size=16, lr=0.1, algorithm="leader",
                    aggregate_every="epoch", seed=1, partition="iid", eval_samples=0, peer_timeout=5, peers=peers,
                    data={"mode": "local", "dataset": "digits"})

    def threads(pid: str, **context) -> int | None:
        ctx = ProviderContext(pid, "127.0.0.1", SECRET, tmp_path / pid, **context)
        return TaskRun(spec, ctx, bytes(32), TaskAccess.of(spec, "")).threads()

    assert threads("p0", cores=4) == threads("p1", cores=4) == 2  # two of the task's providers on 10.0.0.1
    assert threads("p2", cores=4) == 4 and threads("p2") is None  # alone there: all it declared, or torch's default
    assert threads("p0", cores=1) == 1 and threads("p0", cores=4, relayed=True) == 4  # a relay address says nothing
