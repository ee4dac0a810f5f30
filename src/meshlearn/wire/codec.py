"""Versioned binary messages: a struct header with a tensor table, then one raw frame per tensor.

Layout of frame 0 (little-endian)::

    magic "MSHL" | version u8 | kind u8 | flags u16 | sender u32 | iteration u64 | degree u32
    | tensor count u16 | meta length u32
    then per tensor: name length u16 | name (UTF-8) | dtype code u8 | ndim u8 | dims u64 x ndim
                     | byte length u64
    then meta: a small JSON object of plain values (may be empty)

Frames 1..n hold the raw bytes of each tensor, in table order. With a shared secret the header's
SIGNED flag is set and one more frame follows: the HMAC-SHA256 of all the others (``wire.auth``),
checked before anything else is parsed. Nothing is pickled, evaluated or imported: the only
parser for untrusted bytes is ``struct`` plus ``json`` for the capped metadata.
"""

from __future__ import annotations

import enum
import json
import math
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from meshlearn.errors import WireError
from meshlearn.wire.auth import frames_mac, mac_matches

MAGIC = b"MSHL"
VERSION = 1
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
MAX_TENSORS = 4096
MAX_NAME_BYTES = 256
MAX_NDIM = 8
MAX_META_BYTES = 64 * 1024

_FIXED = struct.Struct("<4sBBHIQIHI")
_NAME_LEN = struct.Struct("<H")
_DTYPE_NDIM = struct.Struct("<BB")
_U64 = struct.Struct("<Q")


class Kind(enum.IntEnum):
    """What a message is for."""

    HELLO = 1
    BYE = 2
    MODEL = 3
    REQUEST = 4
    REPLY = 5


# Codes are part of the wire format: never renumber, only append.
DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float64,
    3: torch.float16,
    4: torch.bfloat16,
    5: torch.int64,
    6: torch.int32,
    7: torch.int16,
    8: torch.int8,
    9: torch.uint8,
    10: torch.bool,
}
DTYPE_CODES: dict[torch.dtype, int] = {dtype: code for code, dtype in DTYPES.items()}


@dataclass
class Chunks:
    """Which chunks of a message arrived, for transports that may lose some (UDP).

    ``vector`` is the whole received payload as one tensor; missing chunks read as zeros.
    """

    chunk_bytes: int
    present: torch.Tensor  # bool, one entry per chunk
    vector: torch.Tensor

    @property
    def missing(self) -> int:
        return int((~self.present).sum())


@dataclass
class Message:
    """One message between nodes: who sent it, for which iteration, and named tensors."""

    kind: Kind
    sender: int
    iteration: int = 0
    degree: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    chunks: Chunks | None = None  # set by chunking transports; never sent as such


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    if tensor.device.type != "cpu":
        raise ValueError("wire: tensors must be on the CPU when encoded; copy them once with .cpu()")
    if not tensor.is_contiguous():
        raise ValueError("wire: tensors must be contiguous; call .contiguous() first")
    flat = tensor.reshape(-1)
    if tensor.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return memoryview(flat.numpy()).cast("B")


FLAG_SIGNED = 0x1


def encode(msg: Message, secret: bytes | None = None) -> list[bytes | memoryview]:
    """Encode a message into frames; tensor frames are views of the tensors, not copies.

    The tensors must not be modified until the frames have been sent. With ``secret`` the
    message is signed (one more frame: its HMAC).
    """
    if len(msg.tensors) > MAX_TENSORS:
        raise ValueError(f"wire: at most {MAX_TENSORS} tensors per message")
    meta = json.dumps(msg.meta, separators=(",", ":"), allow_nan=False).encode() if msg.meta else b""
    if len(meta) > MAX_META_BYTES:
        raise ValueError(f"wire: metadata is {len(meta)} bytes, the limit is {MAX_META_BYTES}")
    table = bytearray()
    frames: list[bytes | memoryview] = [b""]
    for name, tensor in msg.tensors.items():
        raw_name = name.encode()
        if len(raw_name) > MAX_NAME_BYTES or tensor.dim() > MAX_NDIM:
            raise ValueError(f"wire: tensor name or rank too large: {name!r}")
        code = DTYPE_CODES.get(tensor.dtype)
        if code is None:
            raise ValueError(f"wire: dtype {tensor.dtype} is not supported")
        data = _tensor_bytes(tensor)
        table += _NAME_LEN.pack(len(raw_name)) + raw_name
        table += _DTYPE_NDIM.pack(code, tensor.dim())
        table += b"".join(_U64.pack(d) for d in tensor.shape)
        table += _U64.pack(data.nbytes)
        frames.append(data)
    header = _FIXED.pack(
        MAGIC, VERSION, int(msg.kind), FLAG_SIGNED if secret else 0, msg.sender, msg.iteration, msg.degree,
        len(msg.tensors), len(meta),
    )
    frames[0] = header + bytes(table) + meta
    if secret:
        frames.append(frames_mac(secret, frames))
    return frames


def sender_of(header: Any) -> int:
    """The sender named by an encoded message's header (frame 0 of ``encode``), for a layer that
    wraps the message and vouches for its sender (``wire.sealed``); ValueError for anything else."""
    view = _frame_view(header)
    if view.nbytes < _FIXED.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise ValueError("wire: not the header frame of an encoded message")
    return _FIXED.unpack_from(view)[4]


def _frame_view(frame: Any) -> memoryview:
    """Bytes of one received frame (bytes, memoryview or a zmq.Frame) without copying."""
    buffer = getattr(frame, "buffer", frame)
    return memoryview(buffer).cast("B") if not isinstance(buffer, memoryview) else buffer.cast("B")


class _Reader:
    """Bounds-checked sequential reads from the header frame."""

    def __init__(self, data: memoryview):
        self.data = data
        self.pos = 0

    def take(self, st: struct.Struct, what: str) -> tuple:
        end = self.pos + st.size
        if end > len(self.data):
            raise WireError(f"truncated header: {what} runs past the end of the header frame")
        values = st.unpack_from(self.data, self.pos)
        self.pos = end
        return values

    def take_bytes(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise WireError(f"truncated header: {what} runs past the end of the header frame")
        out = bytes(self.data[self.pos:end])
        self.pos = end
        return out


def _as_tensor(view: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over the received bytes, without copying them (the tensor is read-only in spirit)."""
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    with warnings.catch_warnings():
        # Received frames are immutable; callers only read them (averaging writes elsewhere).
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(view, dtype=raw_dtype)
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor.view(shape)


def _checked_views(frames: Sequence[Any], max_bytes: int, secret: bytes | None) -> list[memoryview]:
    """The frames as views, within the size cap and, with ``secret``, signed with it (the
    signature frame removed); checked before any of them is parsed."""
    if not frames:
        raise WireError("empty message: no header frame")
    views = [_frame_view(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the size cap of {max_bytes} bytes")
    if secret:
        if len(views) < 2 or not mac_matches(secret, views[:-1], views[-1]):
            raise WireError("message is not signed with this network's secret")
        views = views[:-1]
    return views


def _fixed_header(reader: _Reader, frame_count: int, signed: bool) -> tuple[Kind, int, int, int, int, int]:
    """The fixed header's kind, sender, iteration, degree, tensor count and metadata length, each
    checked: magic, version, kind, flags (``signed``: the SIGNED flag expected), the limits, and
    one tensor frame per announced tensor (``frame_count``: the frames after the signature's removal)."""
    magic, version, kind, flags, sender, iteration, degree, count, meta_len = reader.take(_FIXED, "fixed header")
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a meshlearn message")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this build speaks version {VERSION})")
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError(f"unknown message kind {kind}") from None
    if flags != (FLAG_SIGNED if signed else 0):
        raise WireError(f"header flags {flags:#x} are unknown, or say signed where no secret is set")
    if count > MAX_TENSORS:
        raise WireError(f"tensor count {count} exceeds the limit of {MAX_TENSORS}")
    if meta_len > MAX_META_BYTES:
        raise WireError(f"metadata length {meta_len} exceeds the limit of {MAX_META_BYTES}")
    if frame_count != count + 1:
        raise WireError(f"header announces {count} tensor frames but {frame_count - 1} arrived")
    return kind, sender, iteration, degree, count, meta_len


def _tensor_name(reader: _Reader, index: int) -> str:
    """The name of table entry ``index``: capped in length, valid UTF-8."""
    (name_len,) = reader.take(_NAME_LEN, f"tensor {index} name length")
    if name_len > MAX_NAME_BYTES:
        raise WireError(f"tensor {index}: name of {name_len} bytes exceeds {MAX_NAME_BYTES}")
    try:
        return reader.take_bytes(name_len, f"tensor {index} name").decode()
    except UnicodeDecodeError:
        raise WireError(f"tensor {index}: name is not valid UTF-8") from None


def _tensor_layout(reader: _Reader, name: str, max_bytes: int) -> tuple[torch.dtype, tuple[int, ...], int]:
    """The dtype, shape and byte length of tensor ``name``'s table entry: a known dtype, at most
    ``MAX_NDIM`` dimensions none above ``max_bytes``, and a byte length that matches them."""
    code, ndim = reader.take(_DTYPE_NDIM, f"tensor {name!r} dtype")
    dtype = DTYPES.get(code)
    if dtype is None:
        raise WireError(f"tensor {name!r}: unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise WireError(f"tensor {name!r}: {ndim} dimensions exceed the limit of {MAX_NDIM}")
    shape = tuple(reader.take(_U64, f"tensor {name!r} shape")[0] for _ in range(ndim))
    if any(dim > max_bytes for dim in shape):
        # No real tensor of this message could have such a dimension (an empty one need not).
        raise WireError(f"tensor {name!r}: a dimension of {list(shape)} exceeds the message size cap {max_bytes}")
    (nbytes,) = reader.take(_U64, f"tensor {name!r} byte length")
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes != expected:
        raise WireError(f"tensor {name!r}: byte length {nbytes} does not match {dtype} x {list(shape)} = {expected}")
    return dtype, shape, nbytes


def _tensor_frame(frame: memoryview, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                  nbytes: int) -> torch.Tensor:
    """Tensor ``name`` over its frame, which must hold exactly the ``nbytes`` its entry announced."""
    if frame.nbytes != nbytes:
        raise WireError(f"tensor {name!r}: frame holds {frame.nbytes} bytes, header says {nbytes}")
    try:
        return _as_tensor(frame, dtype, shape)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"tensor {name!r}: torch cannot lay out {dtype} x {list(shape)} ({type(exc).__name__})") from None


def _tensors(reader: _Reader, views: list[memoryview], count: int, max_bytes: int) -> dict[str, torch.Tensor]:
    """The ``count`` tensors of the table, by name (each name once), over frames 1..count."""
    tensors: dict[str, torch.Tensor] = {}
    for index in range(count):
        name = _tensor_name(reader, index)
        if name in tensors:
            raise WireError(f"tensor name {name!r} appears twice")
        dtype, shape, nbytes = _tensor_layout(reader, name, max_bytes)
        tensors[name] = _tensor_frame(views[index + 1], name, dtype, shape, nbytes)
    return tensors


def _metadata(reader: _Reader, meta_len: int) -> dict[str, Any]:
    """The metadata after the table: a JSON object of ``meta_len`` bytes ({} for none)."""
    if not meta_len:
        return {}
    raw = reader.take_bytes(meta_len, "metadata")
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError("metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise WireError("metadata must be a JSON object")
    return meta


def decode(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_BYTES, secret: bytes | None = None) -> Message:
    """Decode and validate frames into a Message; raises WireError on any malformed input.

    With ``secret`` only messages signed with it are accepted, checked before parsing.
    """
    views = _checked_views(frames, max_bytes, secret)
    reader = _Reader(views[0])
    kind, sender, iteration, degree, count, meta_len = _fixed_header(reader, len(views), bool(secret))
    tensors = _tensors(reader, views, count, max_bytes)
    meta = _metadata(reader, meta_len)
    if reader.pos != len(views[0]):
        raise WireError(f"{len(views[0]) - reader.pos} unexpected bytes after the header")
    return Message(kind=kind, sender=sender, iteration=iteration, degree=degree, tensors=tensors, meta=meta)
