"""Encrypted engine messages: every frame of an encoded message sealed with AES-256-GCM.

A network task's providers share one random 32-byte key, made by the requester and handed to
each provider over its encrypted, authenticated control channel (CurveZMQ); it is the run's, not
only the task's: every attempt of a task (each start on a set of providers) gets a fresh one, so
a message sealed in an earlier run opens in no later one and cannot take a sender's counters (or,
over UDP, its session) there, even before that sender's first message of the new run. The engine's
model traffic then needs no channel encryption of its own, and AES-GCM (``cryptography``,
OpenSSL, AES-NI) seals it several times faster than CurveZMQ's XSalsa20-Poly1305 could.

Layout: frame 0 is the seal header (in the clear, authenticated as every chunk's associated
data)::

    magic "MLAE" | version u8 | nonce prefix (8 random bytes) | sender u32 | counter u64
    | frame count u16 | frame sizes u64 x count

then the frames of the encoded message, each cut into chunks of at most 1 MiB (at least one,
so an empty frame still carries a tag), every chunk sealed on its own with the nonce
``prefix || chunk index (u32)``. A chunk moved, dropped, reordered or taken from another message
fails its tag; nothing is decoded before every tag has been checked.

Freshness: the header names the message's sender (the one its encoded header names) and that
sender's message counter (1, 2, ... per ``FrameSeal``). A receiving endpoint keeps a
``ReplayWindow`` and takes each (sender, counter) once, so a message captured on the path and
played again is refused (``ReplayedMessage``), in every algorithm.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from meshlearn.errors import WireError
from meshlearn.wire.codec import DEFAULT_MAX_BYTES, Message, decode, encode, sender_of

MAGIC = b"MLAE"
VERSION = 2  # 2: sender and counter in the header (1 had neither, so its messages could be replayed)
KEY_BYTES = 32
CHUNK = 1 << 20  # AES-GCM runs twice as fast on chunks that stay in cache as on one 45 MB buffer
TAG = 16
MAX_FRAMES = 4096 + 2
WINDOW = 1024  # counters a receiver remembers below a sender's newest: how far its messages may overtake each other
_VERSIONED = struct.Struct("<4sB")
_HEAD = struct.Struct("<4sB8sIQH")
_SIZE = struct.Struct("<Q")


def _view(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", frame)
    return memoryview(buffer).cast("B")


def _chunks(size: int) -> range:
    return range(0, max(size, 1), CHUNK)


class Stamp(NamedTuple):
    """Who sealed a message, and where it stands among that sender's messages (authenticated)."""

    sender: int
    counter: int


class ReplayedMessage(WireError):
    """A sealed message that opens, but whose counter its receiver took before (or is too old to
    tell): played again by someone on the path. ``message`` is what it says (authentic, and old)."""

    def __init__(self, reason: str, message: Message):
        super().__init__(reason)
        self.message = message


class ReplayWindow:
    """The sealed messages one receiving endpoint has taken, per sender: a sliding anti-replay
    window (RFC 4303 section 3.4.3, RFC 6479). A counter above the sender's newest is fresh; one
    less than ``size`` below it is fresh if not taken yet (a sender's threads and sockets may
    overtake each other); an older one is refused, since whether it was taken is forgotten.
    Thread-safe: an endpoint's serving thread and its callers share one."""

    def __init__(self, size: int = WINDOW):
        self.size = size
        self._mask = (1 << size) - 1
        self._senders: dict[int, tuple[int, int]] = {}  # sender -> (newest counter, bit i: newest - i taken)
        self._lock = threading.Lock()

    def admit(self, stamp: Stamp) -> str | None:
        """Take ``stamp`` if it is fresh (None); otherwise say why not, and record nothing."""
        with self._lock:
            newest, taken = self._senders.get(stamp.sender, (0, 1))  # counters start at 1
            behind = newest - stamp.counter
            if behind < 0:
                shifted = (taken << -behind) & self._mask if -behind < self.size else 0
                self._senders[stamp.sender] = (stamp.counter, shifted | 1)
                return None
            if behind >= self.size:
                return (f"sender {stamp.sender}'s message {stamp.counter} is older than the window of {self.size} "
                        f"below its newest, {newest}")
            if taken >> behind & 1:
                return f"sender {stamp.sender}'s message {stamp.counter} was taken before"
            self._senders[stamp.sender] = (newest, taken | 1 << behind)
            return None


def claimed_stamp(header: Any) -> Stamp | None:
    """The stamp a sealed message's header (frame 0) claims, read without checking anything but its
    layout; None where it has none. For naming a message that did not open, so its sender can send
    it again: never for trusting it (only ``FrameSeal.open`` authenticates a stamp)."""
    view = _view(header)
    if view.nbytes < _HEAD.size:
        return None
    magic, version, _, sender, counter, _ = _HEAD.unpack_from(view)
    return Stamp(sender, counter) if magic == MAGIC and version == VERSION else None


class FrameSeal:
    """Seals and opens the frames of engine messages with one task's key (AES-256-GCM)."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a task key is {KEY_BYTES} bytes, not {len(key)}")
        self.key = bytes(key)  # the task's: the UDP transport seals its datagrams with it too (sealed_datagram)
        self._aead = AESGCM(self.key)
        self._counters: dict[int, int] = {}  # sender -> messages sealed so far
        self._lock = threading.Lock()

    @staticmethod
    def new_key() -> bytes:
        """A fresh random task key."""
        return AESGCM.generate_key(bit_length=256)

    def _next_counter(self, sender: int) -> int:
        with self._lock:
            counter = self._counters[sender] = self._counters.get(sender, 0) + 1
        return counter

    def close(self, frames: Sequence[Any]) -> list[Any]:
        """The sealed frames of an encoded message (header first; the others are views of one
        buffer), stamped with its sender and that sender's next counter."""
        views = [_view(f) for f in frames]
        if len(views) > MAX_FRAMES:
            raise ValueError(f"wire: at most {MAX_FRAMES} frames per sealed message")
        sender = sender_of(views[0])
        prefix = os.urandom(8)
        header = _HEAD.pack(MAGIC, VERSION, prefix, sender, self._next_counter(sender), len(views)) \
            + b"".join(_SIZE.pack(v.nbytes) for v in views)
        count = sum(len(_chunks(v.nbytes)) for v in views)
        out = memoryview(numpy.empty(sum(v.nbytes for v in views) + count * TAG, numpy.uint8)).cast("B")
        sealed: list[Any] = [header]
        at = 0
        for view in views:
            for start in _chunks(view.nbytes):
                piece = view[start:start + CHUNK]
                end = at + piece.nbytes + TAG
                self._aead.encrypt_into(prefix + len(sealed).to_bytes(4, "big"), piece, header, out[at:end])
                sealed.append(out[at:end])
                at = end
        return sealed

    def open(self, frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[list[Any], Stamp]:
        """The frames that were sealed and the header's stamp, once every chunk's tag checks;
        WireError otherwise."""
        if not frames:
            raise WireError("empty sealed message")
        header = bytes(_view(frames[0]))
        if len(header) < _VERSIONED.size:
            raise WireError("sealed message header is truncated")
        magic, version = _VERSIONED.unpack_from(header)
        if magic != MAGIC:
            raise WireError(f"bad magic {magic!r}: not a sealed meshlearn message")
        if version != VERSION:
            raise WireError(f"unsupported seal version {version}: this build speaks version {VERSION} (every "
                            "provider of a task must run a meshlearn release that seals alike)")
        if len(header) < _HEAD.size:
            raise WireError("sealed message header is truncated")
        _, _, prefix, sender, counter, count = _HEAD.unpack_from(header)
        if count > MAX_FRAMES or len(header) != _HEAD.size + count * _SIZE.size:
            raise WireError("sealed message header does not match its frame count")
        sizes = [_SIZE.unpack_from(header, _HEAD.size + i * _SIZE.size)[0] for i in range(count)]
        if sum(sizes) > max_bytes:
            raise WireError(f"sealed message of {sum(sizes)} bytes exceeds the size cap of {max_bytes} bytes")
        if len(frames) - 1 != sum(len(_chunks(size)) for size in sizes):
            raise WireError("sealed message has the wrong number of chunks for its frame sizes")
        lengths = [min(CHUNK, size - start) for size in sizes for start in _chunks(size)]
        for index, (frame, length) in enumerate(zip(frames[1:], lengths), start=1):  # before any buffer is made
            if _view(frame).nbytes != length + TAG:
                raise WireError(f"chunk {index} holds {_view(frame).nbytes} bytes, the header says {length + TAG}")
        opened: list[Any] = []
        index = 1
        try:
            for size in sizes:
                plain = numpy.empty(size, numpy.uint8)  # every byte is written below: no zero-filling
                out = memoryview(plain).cast("B")
                for start in _chunks(size):
                    chunk = _view(frames[index])
                    length = min(CHUNK, size - start)
                    self._aead.decrypt_into(prefix + index.to_bytes(4, "big"), chunk, header,
                                            out[start:start + length])
                    index += 1
                opened.append(plain)
        except InvalidTag:
            raise WireError("message is not sealed with this task's key (forged, damaged, or from another "
                            "task or another run of it)") from None
        return opened, Stamp(sender, counter)


def encode_for(msg: Message, secret: bytes | None, seal: FrameSeal | None) -> list:
    """``encode``, then sealed if the endpoint has a seal."""
    frames = encode(msg, secret)
    return seal.close(frames) if seal is not None else frames


def decode_for(frames: Sequence[Any], max_bytes: int, secret: bytes | None, seal: FrameSeal | None,
               window: ReplayWindow | None = None) -> Message:
    """Opened if the endpoint has a seal (refused if it does not open, or if its sender is not
    the one its seal names), then ``decode``; with ``window`` (the receiving endpoint's), a sealed
    message is taken once only (``ReplayedMessage`` otherwise)."""
    if seal is None:
        return decode(frames, max_bytes, secret)
    opened, stamp = seal.open(frames, max_bytes)
    msg = decode(opened, max_bytes, secret)
    if msg.sender != stamp.sender:
        raise WireError(f"the seal names sender {stamp.sender}, the message inside it {msg.sender}")
    problem = window.admit(stamp) if window is not None else None
    if problem is not None:
        raise ReplayedMessage(f"a replayed message: {problem}", msg)
    return msg
