"""Wire format: round trips, every malformed-input case, and fuzzing."""

import struct

import pytest
import torch
from helpers.frames import raw_message
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshlearn.errors import WireError
from meshlearn.wire import DTYPES, Kind, Message, decode, encode
from meshlearn.wire.codec import MAX_META_BYTES, VERSION


def _sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, dtype=dtype)


def _bytes(frames):
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_round_trip_every_dtype(dtype):
    tensor = _sample(dtype)
    msg = Message(Kind.MODEL, sender=7, iteration=123456789012, degree=3, tensors={"t": tensor}, meta={"k": [1, "x"]})
    out = decode(_bytes(encode(msg)))
    assert (out.kind, out.sender, out.iteration, out.degree, out.meta) == (Kind.MODEL, 7, 123456789012, 3, {"k": [1, "x"]})
    assert out.tensors["t"].dtype == dtype
    assert torch.equal(out.tensors["t"], tensor)


def test_round_trip_many_tensors_and_empty_and_scalar():
    tensors = {"a": torch.randn(2, 3, 4), "empty": torch.empty(0, 7), "scalar": torch.tensor(3.5), "ü-name": torch.arange(4)}
    out = decode(_bytes(encode(Message(Kind.REPLY, 1, tensors=tensors))))
    assert list(out.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert out.tensors[name].shape == tensor.shape
        assert torch.equal(out.tensors[name], tensor)


def test_encode_does_not_copy_tensor_data():
    tensor = torch.randn(100_000)
    frames = encode(Message(Kind.MODEL, 0, tensors={"p": tensor}))
    view = frames[1]
    assert isinstance(view, memoryview)
    tensor[0] = 42.0  # the frame is a view of the tensor's memory
    assert struct.unpack_from("<f", view, 0)[0] == 42.0


def test_decode_does_not_copy_frame_data():
    payload = bytearray(torch.arange(10, dtype=torch.float32).numpy().tobytes())
    frames = encode(Message(Kind.MODEL, 0, tensors={"p": torch.zeros(10)}))
    out = decode([frames[0], payload])
    payload[0:4] = struct.pack("<f", 9.0)
    assert out.tensors["p"][0] == 9.0


def _valid() -> list[bytes]:
    return _bytes(encode(Message(Kind.MODEL, 2, 5, 3, {"w": torch.randn(4, 4), "b": torch.randn(4)}, {"x": 1})))


def _patch(header: bytes, offset: int, fmt: str, value) -> bytes:
    data = bytearray(header)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda f: [_patch(f[0], 0, "<4s", b"XXXX")] + f[1:], "bad magic"),
        (lambda f: [_patch(f[0], 4, "<B", VERSION + 1)] + f[1:], "unsupported wire version"),
        (lambda f: [_patch(f[0], 5, "<B", 99)] + f[1:], "unknown message kind"),
        (lambda f: [_patch(f[0], 6, "<H", 1)] + f[1:], "flags"),
        (lambda f: f[:-1], "2 tensor frames but 1 arrived"),
        (lambda f: f + [b"extra"], "2 tensor frames but 3 arrived"),
        (lambda f: [f[0][:10]] + f[1:], "truncated header"),
        (lambda f: [f[0][:40]] + f[1:], "truncated header"),
        (lambda f: [f[0] + b"junk"] + f[1:], "unexpected bytes"),
        (lambda f: [f[0], f[1][:-4], f[2]], "frame holds 60 bytes"),
        (lambda f: [], "empty message"),
    ],
    ids=["magic", "version", "kind", "flags", "missing-frame", "extra-frame", "short-fixed", "short-table",
         "trailing", "short-frame", "empty"],
)
def test_malformed_rejected(mutate, match):
    with pytest.raises(WireError, match=match):
        decode(mutate(_valid()))


def _table_offset() -> int:
    return struct.calcsize("<4sBBHIQIHI")


def test_unknown_dtype_and_length_mismatch_rejected():
    frames = _valid()
    name_len = struct.unpack_from("<H", frames[0], _table_offset())[0]
    dtype_at = _table_offset() + 2 + name_len
    with pytest.raises(WireError, match="unknown dtype code"):
        decode([_patch(frames[0], dtype_at, "<B", 200)] + frames[1:])
    # claim float64: byte length no longer equals dtype x shape
    with pytest.raises(WireError, match="does not match"):
        decode([_patch(frames[0], dtype_at, "<B", 2)] + frames[1:])
    with pytest.raises(WireError, match="dimensions exceed"):
        decode([_patch(frames[0], dtype_at + 1, "<B", 40)] + frames[1:])


def test_size_cap():
    frames = _valid()
    total = sum(len(f) for f in frames)
    assert decode(frames, max_bytes=total).sender == 2
    with pytest.raises(WireError, match="exceeds the size cap"):
        decode(frames, max_bytes=total - 1)


def test_bad_metadata_rejected():
    header = bytearray(_valid()[0])
    header[-7:] = b"{not js"
    with pytest.raises(WireError, match="metadata"):
        decode([bytes(header)] + _valid()[1:])
    assert MAX_META_BYTES >= 1024


def test_encoder_refuses_what_it_cannot_send():
    with pytest.raises(ValueError):
        encode(Message(Kind.MODEL, 0, tensors={"c": torch.zeros(3, dtype=torch.complex64)}))
    with pytest.raises(ValueError):
        encode(Message(Kind.MODEL, 0, tensors={"t": torch.zeros(4, 4).t()}))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=5))
def test_fuzz_random_frames_only_raise_wire_error(frames):
    try:
        decode(frames, max_bytes=10_000)
    except WireError:
        pass


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_valid_messages_only_raise_wire_error(data):
    frames = _valid()
    index = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[index])
    for _ in range(data.draw(st.integers(1, 8))):
        if not frame:
            break
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, len(frame) - 1))
        if op == "flip":
            frame[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del frame[pos:]
        else:
            frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=9))
    frames[index] = bytes(frame)
    try:
        out = decode(frames, max_bytes=100_000)
    except WireError:
        return
    for tensor in out.tensors.values():  # whatever decoded must be fully readable
        tensor.sum()


def test_signed_messages_round_trip_and_refuse_the_wrong_secret():
    msg = Message(Kind.MODEL, 3, 7, 2, {"w": torch.arange(10, dtype=torch.float32)})
    frames = [bytes(memoryview(f)) for f in encode(msg, b"network-secret")]
    assert torch.equal(decode(frames, secret=b"network-secret").tensors["w"], msg.tensors["w"])
    with pytest.raises(WireError, match="not signed with this network's secret"):
        decode(frames, secret=b"another-secret")
    tampered = list(frames)
    tampered[1] = b"\x00" * len(tampered[1])
    with pytest.raises(WireError, match="not signed"):
        decode(tampered, secret=b"network-secret")
    with pytest.raises(WireError, match="not signed"):  # an unsigned message where a secret is set
        decode([bytes(memoryview(f)) for f in encode(msg)], secret=b"network-secret")
    with pytest.raises(WireError):  # a signed message where none is expected
        decode(frames)


@pytest.mark.parametrize("dims", [[0, 2**64 - 1], [2**64 - 1, 0], [0, 2**63], [0, 2**63 - 1], [2**40, 0, 2**40]])
def test_an_empty_tensor_with_a_huge_dimension_is_a_wire_error(dims):
    with pytest.raises(WireError, match="dimension"):
        decode(raw_message([(1, dims, 0)]))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_shapes_dims_and_counts_only_raise_wire_error(data):
    dim = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1), st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]))
    table = data.draw(st.lists(st.tuples(st.sampled_from(sorted(DTYPES) + [0, 255]),
                                         st.lists(dim, max_size=9),
                                         st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1))), max_size=4))
    count = data.draw(st.one_of(st.none(), st.integers(0, 2**16 - 1)))
    try:
        out = decode(raw_message(table, count), max_bytes=1_000_000)
    except WireError:
        return
    for tensor in out.tensors.values():
        tensor.sum()


# --- sealed messages: who sent them, and each taken once ----------------------------------------


def _sealed(seal, sender=1, iteration=0):
    from meshlearn.wire.sealed import encode_for

    msg = Message(Kind.MODEL, sender, iteration, 1, {"w": torch.arange(6, dtype=torch.float32)})
    return [bytes(memoryview(f)) for f in encode_for(msg, None, seal)]


def test_the_replay_window_takes_each_counter_once_in_any_order_within_it():
    from meshlearn.wire.sealed import ReplayWindow, Stamp

    window = ReplayWindow(size=8)
    assert [window.admit(Stamp(1, c)) for c in (1, 2, 3)] == [None] * 3  # in order
    assert window.admit(Stamp(1, 6)) is None  # ahead, leaving 4 and 5 open
    assert window.admit(Stamp(1, 5)) is None and window.admit(Stamp(1, 4)) is None  # out of order, within the window
    assert "taken before" in window.admit(Stamp(1, 5))  # a duplicate
    assert window.admit(Stamp(2, 5)) is None  # every sender counts on its own
    assert window.admit(Stamp(1, 14)) is None  # 6 is now as far behind as the window reaches
    assert "older than the window" in window.admit(Stamp(1, 6))
    assert window.admit(Stamp(1, 7)) is None  # never taken, and still inside
    assert window.admit(Stamp(1, 2**64 - 1)) is None  # far ahead (an authentic counter: the sender's own jump)
    assert "older than the window" in window.admit(Stamp(1, 14))
    assert "taken before" in window.admit(Stamp(1, 2**64 - 1))
    assert "taken before" in window.admit(Stamp(3, 0))  # counters start at 1


def test_a_sealed_message_is_taken_once_and_names_its_true_sender(monkeypatch):
    from meshlearn.wire import sealed
    from meshlearn.wire.sealed import FrameSeal, ReplayedMessage, ReplayWindow, decode_for

    seal, window = FrameSeal(FrameSeal.new_key()), ReplayWindow()
    first, second = _sealed(seal, iteration=1), _sealed(seal, iteration=2)
    assert decode_for(second, 1 << 20, None, seal, window).iteration == 2  # overtaken by the next one
    assert decode_for(first, 1 << 20, None, seal, window).iteration == 1
    with pytest.raises(ReplayedMessage, match="taken before") as replay:
        decode_for(first, 1 << 20, None, seal, window)
    assert replay.value.message.iteration == 1  # what the copy says: authentic, and old
    assert decode_for(first, 1 << 20, None, seal, ReplayWindow()).iteration == 1  # another receiver takes it
    monkeypatch.setattr(sealed, "sender_of", lambda header: 2)  # a key holder stamping another sender
    with pytest.raises(WireError, match="names sender 2, the message inside it 1"):
        decode_for(_sealed(seal), 1 << 20, None, seal, window)


def test_a_seal_counts_each_senders_messages_from_any_thread():
    from concurrent.futures import ThreadPoolExecutor

    from meshlearn.wire.sealed import _HEAD, FrameSeal

    seal = FrameSeal(FrameSeal.new_key())
    with ThreadPoolExecutor(4) as pool:
        headers = list(pool.map(lambda i: _sealed(seal, sender=i % 2)[0], range(200)))
    stamps = [_HEAD.unpack_from(header)[3:5] for header in headers]
    for sender in (0, 1):
        assert sorted(c for s, c in stamps if s == sender) == list(range(1, 101))


def test_a_version_1_seal_is_refused_with_a_clear_error():
    from meshlearn.wire.sealed import MAGIC, FrameSeal, decode_for

    seal = FrameSeal(FrameSeal.new_key())
    frames = _sealed(seal)
    sizes = frames[0][-16:]  # two frames: the version 1 layout had no sender and no counter
    old = struct.pack("<4sB8sH", MAGIC, 1, bytes(8), 2) + sizes
    with pytest.raises(WireError, match="unsupported seal version 1: this build speaks version 2"):
        decode_for([old, *frames[1:]], 1 << 20, None, seal)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_seal_headers_only_raise_wire_error(data):
    from meshlearn.wire.sealed import FrameSeal, ReplayWindow, decode_for

    seal = FrameSeal(b"k" * 32)
    frames = _sealed(seal)
    header = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        header[data.draw(st.integers(0, len(header) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del header[data.draw(st.integers(0, len(header) - 1)):]
    assume(bytes(header) != frames[0])  # any change at all: the header is every chunk's associated data
    with pytest.raises(WireError):
        decode_for([bytes(header), *frames[1:]], 1 << 20, None, seal, ReplayWindow())
