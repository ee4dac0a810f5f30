"""Every decoder of input from outside raises only its own error, whatever it is given.

One property per decoder (docs/security.md lists them, each with its error), each fed what an
attacker (an outsider, or an insider holding the network secret) can send: valid encodings cut
short, with bits flipped, or grown past a cap; JSON nested too deep; integers too large for a
float or a C type, negative ones; values of the wrong type. Each asserts that decoding either
succeeds or raises exactly the decoder's own error class (or a subclass of it): any other
exception would reach a serving loop or a node as a crash. The examples after the properties are
the inputs that escaped before they were fixed.
"""

import asyncio
import hashlib
import json
import random
import tempfile
import time
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshlearn.checkpoint import CheckpointStore, RunCheckpoints, Stateful, capture, decode, parse_checkpoint, restore
from meshlearn.dashboard.access import TokenGate
from meshlearn.errors import AuthError, BadMessage, CheckpointError, NetworkError, WireError
from meshlearn.layout import TensorLayout
from meshlearn.network.bootstrap.taskboard import TaskBoard
from meshlearn.network.channel.envelope import Envelope, field_of, seal, unseal
from meshlearn.network.channel.identity import peer_key
from meshlearn.network.channel.reflector import answer as reflector_answer
from meshlearn.network.channel.reflexive import decode_reply, decode_request, encode_reply, encode_request
from meshlearn.network.protocol.bootstrapapi import TaskProgress
from meshlearn.network.provider.taskdata import chunk_source
from meshlearn.network.task.datashare import dataset_from_shards, download
from meshlearn.network.task.spec import TaskSpec
from meshlearn.transport.udp.reassembly import Reassembler
from meshlearn.wire import Kind, Message
from meshlearn.wire.auth import frames_mac
from meshlearn.wire.codec import decode as wire_decode
from meshlearn.wire.codec import encode
from meshlearn.wire.datagram import HEADER_SIZE, pack_fields, parse_datagram, parse_header
from meshlearn.wire.sealed import FrameSeal, ReplayWindow, decode_for
from meshlearn.wire.sealed_datagram import OVERHEAD, DatagramSeal

FAST = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
SECRET = b"fuzzing-secret"
KEY = b"k" * 32

# --- what an attacker sends -------------------------------------------------------------------------

BIG_INTS = st.sampled_from([-1, -2**63, 2**31, 2**32, 2**63, 2**64, 2**128, 2**200, -2**200, 10**400, -10**400])
NUMBERS = st.one_of(st.integers(-3, 3), BIG_INTS, st.integers(), st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)


def nested(depth: int, opener: str = "[") -> bytes:
    """JSON text nested ``depth`` deep (lists, or objects under key "a")."""
    if opener == "[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"0" + b"}" * depth


DEEP = st.builds(nested, st.sampled_from([70, 900, 5_000, 200_000]), st.sampled_from(["[", "{"]))


def mutated(data, blob: bytes) -> bytes:
    """``blob`` cut short, with bits flipped, or grown (bytes inserted or appended)."""
    out = bytearray(blob)
    operation = data.draw(st.sampled_from(["cut", "flip", "grow", "cut"]))
    if operation == "cut":
        return bytes(out[:data.draw(st.integers(0, max(0, len(out) - 1)))])
    if operation == "flip" and out:
        for _ in range(data.draw(st.integers(1, 6))):
            out[data.draw(st.integers(0, len(out) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        return bytes(out)
    at = data.draw(st.integers(0, len(out)))
    return bytes(out[:at] + data.draw(st.binary(min_size=1, max_size=64)) + out[at:])


def only(error: type[BaseException] | tuple, decoder, *args, **kwargs):
    """``decoder(*args)``'s value, or None where it raised ``error``: anything else fails the test."""
    try:
        return decoder(*args, **kwargs)
    except error:
        return None


# --- the engine's wire ------------------------------------------------------------------------------

def _message() -> Message:
    return Message(Kind.MODEL, 3, 7, 2, {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3)}, {"n": 1})


@FAST
@given(st.data())
def test_the_codec_raises_only_wire_error(data):
    frames = [bytes(memoryview(f)) for f in encode(_message(), SECRET if data.draw(st.booleans()) else None)]
    index = data.draw(st.integers(0, len(frames) - 1))
    frames[index] = mutated(data, frames[index])
    if data.draw(st.booleans()):
        frames = frames[:data.draw(st.integers(0, len(frames)))]
    secret = data.draw(st.sampled_from([None, SECRET]))
    message = only(WireError, wire_decode, frames, data.draw(st.sampled_from([64, 10_000])), secret)
    for tensor in (message.tensors.values() if message else ()):
        tensor.sum()


@FAST
@given(st.one_of(JSON, DEEP))
def test_the_codec_raises_only_wire_error_for_any_metadata(meta):
    frames = [bytes(memoryview(f)) for f in encode(_message())]
    text = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    frames[0] = frames[0][:frames[0].rindex(b'{"n":1}')] + text[:65_536]
    length = len(text[:65_536]).to_bytes(4, "little")
    frames[0] = frames[0][:26] + length + frames[0][30:]  # the fixed header's metadata length (its last field)
    only(WireError, wire_decode, frames)


@FAST
@given(st.data())
def test_a_sealed_message_raises_only_wire_error(data):
    seal = FrameSeal(KEY)
    frames = [bytes(memoryview(f)) for f in seal.close(encode(_message()))]
    index = data.draw(st.integers(0, len(frames) - 1))
    frames[index] = mutated(data, frames[index])
    if data.draw(st.booleans()):  # a header that claims huge frames (oversize), over chunks that are not there
        count = data.draw(st.integers(0, 5))
        frames[0] = frames[0][:25] + count.to_bytes(2, "little") + b"".join(
            data.draw(st.sampled_from([0, 1, 2**20, 2**29, 2**63, 2**64 - 1])).to_bytes(8, "little")
            for _ in range(count))
    only(WireError, decode_for, frames, data.draw(st.sampled_from([1 << 10, 1 << 30])), None, seal, ReplayWindow())


def _datagram(data) -> bytes:
    """A datagram whose header's fields are each in range and whose checksum matches (so every
    check past it is reached): half the time a chunk of the 48-byte model the reassembler below
    expects (3 chunks of 16 bytes, from any sender, of any iteration), so the reassembly is reached."""
    u32 = st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1))
    u64 = st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1))
    sender, iteration, degree = data.draw(u32), data.draw(u64), data.draw(u32)
    if data.draw(st.booleans()):
        kind, flags, index, count, chunk, total = Kind.MODEL, 0, data.draw(st.integers(0, 2)), 3, 16, 48
    else:
        kind = data.draw(st.sampled_from([0, 255, *Kind]))
        flags, index, count = data.draw(st.integers(0, 255)), data.draw(u32), data.draw(u32)
        chunk, total = data.draw(st.one_of(st.sampled_from([8, 16, 65507, 65508]), u32)), data.draw(u64)
    fits = max(0, min(chunk, total - index * chunk, 64))  # the payload a chunk of these numbers carries
    payload = data.draw(st.one_of(st.binary(min_size=fits, max_size=fits), st.binary(max_size=64)))
    return pack_fields(kind, flags, sender, iteration, index, count, chunk, degree, total, [payload]) + payload


@FAST
@given(st.data())
def test_a_datagram_raises_only_wire_error_and_reassembles_or_is_refused(data):
    """Datagrams as they come, cut short or flipped, each fed to one reassembler as the receive
    thread feeds it."""
    reassembler = Reassembler(TensorLayout.uniform({"all": (0, 12)}, torch.float32), chunk_bytes=16)
    for _ in range(data.draw(st.integers(1, 4))):
        datagram = _datagram(data)
        if data.draw(st.booleans()):
            datagram = mutated(data, datagram)
        parsed = only(WireError, parse_datagram, memoryview(datagram), 1 << 16)
        only(WireError, parse_header, memoryview(datagram[:HEADER_SIZE]), 1 << 16)
        if parsed is not None:
            only(WireError, reassembler.add, *parsed)


@FAST
@given(st.data())
def test_a_sealed_datagram_raises_only_wire_error(data):
    seal = DatagramSeal(KEY)
    head = pack_fields(Kind.MODEL, 0, 1, 0, 0, 1, 16, 1, 16, [b"p" * 16])
    nonce, sealed = seal.close(head, b"p" * 16)
    body = mutated(data, nonce + sealed)
    size = data.draw(st.sampled_from([16, max(0, len(body) - OVERHEAD)]))
    only(WireError, seal.open, memoryview(head), memoryview(body), memoryview(bytearray(size)))


@FAST
@given(st.data())
def test_a_reflexive_datagram_raises_only_wire_error_and_the_reflector_answers_only_requests(data):
    """Requests and replies as strangers send them to the bootstrap's reflector and to a peer asking
    for its address, cut short, flipped or grown."""
    blob = data.draw(st.sampled_from([encode_request(b"n" * 16), encode_reply(b"n" * 16, ("198.18.1.2", 40000))]))
    datagram = mutated(data, blob) if data.draw(st.booleans()) else blob
    only(WireError, decode_request, datagram)
    only(WireError, decode_reply, datagram)
    reply = reflector_answer(datagram, ("203.0.113.7", 5000))
    assert reply is None or (len(reply) <= len(datagram) and decode_request(datagram))


# --- the network's control messages ------------------------------------------------------------------

def _signed(header: bytes, blobs=()) -> list[bytes]:
    frames = [header, *blobs]
    return frames + [frames_mac(SECRET, frames)]


def _header(**changes) -> dict:
    # a whole second: a header of one length every time, so that hypothesis replays what it drew
    return {"v": 1, "kind": "k", "from": "a", "id": "i", "ts": int(time.time()), "body": {}, "blobs": [], **changes}


@FAST
@given(st.data())
def test_a_control_message_raises_only_auth_error_or_bad_message(data):
    """Signed with the secret (an insider's), so every check past the signature is reached."""
    field = data.draw(st.sampled_from(["v", "kind", "from", "id", "ts", "body", "blobs", None]))
    header = json.dumps(_header(**({field: data.draw(JSON)} if field else {}))).encode()
    choice = data.draw(st.sampled_from(["as is", "mutated", "deep", "digits"]))
    if choice == "mutated":
        header = mutated(data, header)
    elif choice == "deep":
        header = data.draw(DEEP)
    elif choice == "digits":  # a number of more digits than Python converts (4,300)
        header = header.replace(b'"ts":', b'"ts":' + b"9" * data.draw(st.sampled_from([400, 4_301, 20_000])) + b',"_":')
    frames = _signed(header)
    if data.draw(st.booleans()):  # a frame damaged after signing: refused by the signature, or a cap
        index = data.draw(st.integers(0, len(frames) - 1))
        frames[index] = mutated(data, frames[index])
    only((AuthError, BadMessage), unseal, frames, SECRET, data.draw(st.sampled_from([64, 1 << 22])))


@FAST
@given(st.dictionaries(st.sampled_from(["a", "b"]), JSON, max_size=2),
       st.sampled_from([int, float, (int, float), str, list, dict, bool, (int, type(None))]),
       st.sampled_from([None, 0, 1]))
def test_a_body_field_raises_only_bad_message_and_what_it_returns_fits(body, kind, min_value):
    value = only(BadMessage, field_of, body, "a", kind, min_value=min_value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        float(value)  # a number taken from a body can be used as one
        assert min_value is None or value >= min_value


@FAST
@given(st.dictionaries(st.sampled_from(["providers", "faults", "result"]), JSON, max_size=3),
       st.dictionaries(st.sampled_from(["state", "iteration", "iterations", "train_loss", "test_acc", "evaluated_at",
                                        "leader"]), JSON, max_size=4))
def test_a_progress_report_raises_only_bad_message(body, state):
    if state:
        body["providers"] = {"p1": state}
    report = only(BadMessage, TaskProgress.read, {"task": "t1", **body}, "task.progress")
    board = TaskBoard()
    if report is not None:
        board.report(report)
        json.dumps(board.view("t1"))  # what it took is fit for the page


SPEC = {"task_id": "t1", "model": "mlp", "epochs": 1, "batch_size": 4, "lr": 0.1, "algorithm": "dpsgd",
        "aggregate_every": 1, "seed": 1, "partition": "iid", "eval_samples": 0, "peer_timeout": 5,
        "peers": [{"id": "p", "address": "a"}], "data": {"mode": "local", "dataset": "digits"}}


@FAST
@given(st.dictionaries(st.sampled_from(sorted(TaskSpec.model_fields)), st.one_of(JSON, st.sampled_from(
    ["nesterov:lr=1e400", "epsilon=nan,delta=1e-5", "krum:f=1", "trimmed:0.2", "leader", "udp", "epoch"])),
    max_size=4))
def test_a_task_spec_raises_only_bad_message(changes):
    only(BadMessage, TaskSpec.parse, {**SPEC, **changes})


@FAST
@given(st.one_of(JSON, st.text(min_size=43, max_size=43)))
def test_a_key_from_the_network_raises_only_bad_message(text):
    only(BadMessage, peer_key, text)


@FAST
@given(st.one_of(JSON, st.fixed_dictionaries({"size": JSON, "sha256": JSON})))
def test_a_manifest_entry_raises_only_network_errors(entry):
    """An entry refused, or taken: then the download stops before its first chunk (``before_chunk``)."""
    with tempfile.TemporaryDirectory() as folder:
        only((NetworkError, _Stopped), download, chunk_source("tcp://127.0.0.1:1", SECRET, ""), "f.bin", entry,
             Path(folder), retries=0, before_chunk=_stop)


class _Stopped(Exception):
    pass


def _stop():
    raise _Stopped  # a manifest entry that passed: the download would begin here


@FAST
@given(st.dictionaries(st.sampled_from(["name", "num_classes", "class_names", "mean", "std", "task"]), JSON,
                       max_size=6))
def test_a_data_description_raises_only_network_error(changes):
    meta = {"name": "d", "num_classes": 2, "class_names": ["a", "b"], "mean": [0.5], "std": [0.5], **changes}
    images = (torch.zeros(2, 1, 2, 2), torch.tensor([0, 1]))
    only(NetworkError, dataset_from_shards, meta, images, images)


# --- checkpoints ------------------------------------------------------------------------------------

class _Part(Stateful):
    state_fields = ("weights", "order", "numpy_rng", "torch_rng", "python_rng", "pairs", "shape", "optimizer")

    def __init__(self):
        self.weights = torch.arange(6.0)
        parameter = torch.nn.Parameter(torch.ones(3))
        self.optimizer = torch.optim.SGD([parameter], lr=0.1, momentum=0.9)
        parameter.sum().backward()
        self.optimizer.step()  # so that it has state: a momentum buffer
        self.order = np.arange(4)
        self.numpy_rng = np.random.default_rng(5)
        self.torch_rng = torch.Generator().manual_seed(5)
        self.python_rng = random.Random(5)
        self.pairs = {(1, 2): 3}
        self.shape = (4, 5)


@cache
def _checkpoint() -> tuple[bytes, bytes]:
    """A valid checkpoint's two files (meta JSON, safetensors)."""
    with tempfile.TemporaryDirectory() as folder:
        store = CheckpointStore(folder)
        where = store.save(1, "w", {"part": capture(_Part())}, {"note": "x"})
        return (where / "w.json").read_bytes(), (where / "w.safetensors").read_bytes()


def _slots(tree):
    """(container, key) of every value in a JSON tree."""
    for key, value in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
        yield tree, key
        if isinstance(value, (dict, list)):
            yield from _slots(value)


def _meta_for(meta: dict, tensors: bytes) -> bytes:
    return json.dumps({**meta, "sha256": hashlib.sha256(tensors).hexdigest()}).encode()


TENSORS = st.builds(lambda dtype, shape: torch.zeros(shape, dtype=dtype),
                    st.sampled_from([torch.uint8, torch.float32, torch.int64, torch.bool, torch.bfloat16]),
                    st.lists(st.integers(0, 6), max_size=3))
VALUES = st.one_of(JSON, TENSORS, st.lists(st.one_of(SCALARS, TENSORS), max_size=3))
MARKERS = ["$tensor", "$array", "$numpy_rng", "$torch_rng", "$python_rng", "$optimizer", "$object", "$tuple",
           "$pairs", "$file"]


def _numpy_states(data) -> dict:
    """numpy PCG64 states with fields of any value (huge, negative, of the wrong type, missing)."""
    state = np.random.default_rng(1).bit_generator.state
    for _ in range(data.draw(st.integers(1, 3))):
        field = data.draw(st.sampled_from(["state", "inc", "has_uint32", "uinteger", "bit_generator", "extra"]))
        value = data.draw(st.one_of(NUMBERS, SCALARS, JSON))
        if field in ("state", "inc"):
            state["state"] = {**state["state"], field: value}
        else:
            state[field] = value
    return state


@FAST
@given(st.data())
def test_a_checkpoint_tree_raises_only_checkpoint_error(data):
    """``decode`` of trees with every marker over values of any kind, generators' states included."""
    marker = data.draw(st.sampled_from(MARKERS))
    if marker == "$numpy_rng":
        value = _numpy_states(data)
    elif marker == "$python_rng":
        value = data.draw(st.one_of(VALUES, st.tuples(st.sampled_from([3, 2, 2**70]), st.lists(
            st.one_of(st.integers(0, 2**32 - 1), BIG_INTS), min_size=624, max_size=626), st.one_of(NUMBERS, st.none())
        ).map(list)))
    else:
        value = data.draw(VALUES)
    tree = {marker: value, **data.draw(st.dictionaries(st.sampled_from(["dtype", *MARKERS]), VALUES, max_size=2))}
    for _ in range(data.draw(st.sampled_from([0, 0, 1, 80]))):
        tree = data.draw(st.sampled_from([[tree], {"a": tree}, {"$tuple": [tree]}, {"$pairs": [[1, tree]]}]))
    only(CheckpointError, decode, tree)


@FAST
@given(st.data())
def test_a_checkpoints_files_raise_only_checkpoint_error_and_restore_only_what_fits(data):
    meta_bytes, tensor_bytes = _checkpoint()
    target = data.draw(st.sampled_from(["meta", "tensors", "state", "deep", "oversize"]))
    if target == "meta":
        meta_bytes = mutated(data, meta_bytes)
    elif target == "tensors":  # the checksum made to match, so the safetensors parser is reached
        tensor_bytes = mutated(data, tensor_bytes)
        meta_bytes = _meta_for(json.loads(meta_bytes), tensor_bytes)
    elif target == "state":  # a value anywhere in the state replaced by anything
        meta = json.loads(meta_bytes)
        node, key = data.draw(st.sampled_from(list(_slots(meta["state"]))))
        node[key] = data.draw(st.one_of(JSON, st.fixed_dictionaries({data.draw(st.sampled_from(MARKERS)): JSON})))
        meta_bytes = json.dumps(meta).encode()
    elif target == "deep":
        meta = json.loads(meta_bytes)
        text = json.dumps({**meta, "state": "@"}).encode()
        meta_bytes = text.replace(b'"@"', b'{"part":' + data.draw(DEEP) + b"}")
    else:  # a tensor file that claims a huge tensor
        claim = {"t0": {"dtype": "F32", "shape": [data.draw(st.sampled_from([2**31, 2**40, 2**63]))],
                        "data_offsets": [0, data.draw(st.sampled_from([4, 2**62]))]}}
        header = json.dumps(claim).encode()
        tensor_bytes = len(header).to_bytes(8, "little") + header + b"\0" * 4
        meta_bytes = _meta_for(json.loads(meta_bytes), tensor_bytes)
    parsed = only(CheckpointError, parse_checkpoint, meta_bytes, tensor_bytes, 1)
    if parsed is not None:  # as a run restores its parts from a checkpoint it loaded
        only(CheckpointError, RunCheckpoints("unused", "w", "").restore, parsed[1], {"part": _Part()})


def test_a_valid_checkpoint_restores_every_kind_of_state():
    """The fuzzed encoding is a valid one: unchanged, it decodes and restores."""
    meta, tree = parse_checkpoint(*_checkpoint(), 1)
    part = _Part()
    part.numpy_rng.random(3)
    restore(part, tree["part"])
    assert meta["note"] == "x" and part.numpy_rng.random() == np.random.default_rng(5).random()
    assert part.pairs == {(1, 2): 3} and part.shape == (4, 5)


# --- the dashboard's gate ---------------------------------------------------------------------------

@FAST
@given(st.sampled_from(["127.0.0.1", "10.0.0.2", "::1", ""]), st.binary(max_size=64),
       st.lists(st.tuples(st.sampled_from([b"host", b"authorization", b"cookie", b"x"]), st.binary(max_size=64)),
                max_size=4))
def test_the_dashboards_gate_answers_any_request(client, query, headers):
    """Its own answer to anything it cannot read is a refusal: it never raises."""
    sent, passed = [], []

    async def app(scope, receive, send):
        passed.append(scope)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "client": (client, 1), "query_string": query, "headers": headers, "path": "/x"}
    asyncio.run(TokenGate(app, "token-1")(scope, None, send))
    assert passed or sent[0]["status"] in (303, 401, 403)


# --- the inputs that escaped their decoders before ---------------------------------------------------

def test_a_checkpoint_nested_deeper_than_json_can_read_is_a_checkpoint_error():
    meta_bytes, tensor_bytes = _checkpoint()
    deep = json.dumps({**json.loads(meta_bytes), "state": "@"}).encode().replace(b'"@"', nested(100_000))
    with pytest.raises(CheckpointError, match="not valid JSON"):  # was RecursionError
        parse_checkpoint(deep, tensor_bytes, 1)
    shallower = json.dumps({**json.loads(meta_bytes), "state": "@"}).encode().replace(b'"@"', nested(900))
    with pytest.raises(CheckpointError, match="nests deeper than"):  # JSON reads it; the walks after it would not
        parse_checkpoint(shallower, tensor_bytes, 1)


def test_a_numpy_generator_state_with_a_huge_integer_is_a_checkpoint_error():
    state = np.random.default_rng(1).bit_generator.state
    state["state"]["state"] = 2**200
    with pytest.raises(CheckpointError, match="not a PCG64 state"):  # was OverflowError
        decode({"$numpy_rng": state})


def test_a_torch_generator_state_of_the_wrong_type_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="not a torch generator's state"):  # was TypeError
        decode({"$torch_rng": torch.zeros(3)})


def test_a_control_message_with_a_huge_timestamp_or_number_is_a_bad_message():
    digits = json.dumps(_header()).replace('"ts":', '"ts":' + "9" * 5000 + ',"_":')  # more than Python converts
    for text in (json.dumps(_header(ts=10**400)), digits):
        with pytest.raises(BadMessage):  # were OverflowError and ValueError, in a server's serving thread
            unseal(_signed(text.encode()), SECRET, 1 << 22)


def test_a_body_number_too_large_for_a_float_is_a_bad_message():
    with pytest.raises(BadMessage, match="out of range"):  # was returned, and float() of it raised OverflowError
        field_of({"ram_gb": 10**400}, "ram_gb", (int, float), min_value=0)
    with pytest.raises(BadMessage, match="at least"):  # NaN was taken as at least anything
        field_of({"ram_gb": float("nan")}, "ram_gb", (int, float), min_value=0)
    with pytest.raises(BadMessage):  # was OverflowError
        TaskProgress.read({"task": "t1", "providers": {"p1": {"train_loss": 10**400}}}, "task.progress")


def test_a_data_description_or_manifest_entry_out_of_range_is_a_network_error(tmp_path):
    images = (torch.zeros(2, 1, 2, 2), torch.tensor([0, 1]))
    meta = {"name": "d", "num_classes": float("inf"), "class_names": ["a", "b"], "mean": [0.5], "std": [0.5]}
    with pytest.raises(NetworkError):  # was OverflowError
        dataset_from_shards(meta, images, images)
    with pytest.raises(BadMessage, match="manifest"):  # was KeyError
        download(chunk_source("tcp://127.0.0.1:1", SECRET, ""), "f.bin", {"sha256": "0" * 64}, tmp_path, retries=0)


def test_a_short_datagram_header_is_a_wire_error():
    with pytest.raises(WireError, match="shorter"):  # was struct.error
        parse_header(memoryview(b"MSHU"), 1 << 16)


def test_an_envelope_that_opens_keeps_its_fields():
    """The control message fuzzed above is a valid one: unchanged, it opens as sent."""
    envelope = unseal(seal(Envelope("k", {"a": 1}, [b"xy"], "me"), SECRET), SECRET, 1 << 20)
    assert (envelope.kind, envelope.body, bytes(envelope.blobs[0]), envelope.sender) == ("k", {"a": 1}, b"xy", "me")
