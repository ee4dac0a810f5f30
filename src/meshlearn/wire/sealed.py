"""Encrypted engine messages: every frame of an encoded message sealed with AES-256-GCM.

A network task's providers share one random 32-byte key, made by the requester and handed to
each provider over its encrypted, authenticated control channel (CurveZMQ): the engine's
model traffic then needs no channel encryption of its own, and AES-GCM (``cryptography``,
OpenSSL, AES-NI) seals it several times faster than CurveZMQ's XSalsa20-Poly1305 could.

Layout: frame 0 is the seal header (in the clear, authenticated as every chunk's associated
data)::

    magic "MLAE" | version u8 | nonce prefix (8 random bytes) | frame count u16 | frame sizes u64 x count

then the frames of the encoded message, each cut into chunks of at most 1 MiB (at least one,
so an empty frame still carries a tag), every chunk sealed on its own with the nonce
``prefix || chunk index (u32)``. A chunk moved, dropped, reordered or taken from another message
fails its tag; nothing is decoded before every tag has been checked.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from meshlearn.errors import WireError
from meshlearn.wire.codec import DEFAULT_MAX_BYTES, Message, decode, encode

MAGIC = b"MLAE"
VERSION = 1
KEY_BYTES = 32
CHUNK = 1 << 20  # AES-GCM runs twice as fast on chunks that stay in cache as on one 45 MB buffer
TAG = 16
MAX_FRAMES = 4096 + 2
_HEAD = struct.Struct("<4sB8sH")
_SIZE = struct.Struct("<Q")


def _view(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", frame)
    return memoryview(buffer).cast("B")


def _chunks(size: int) -> range:
    return range(0, max(size, 1), CHUNK)


class FrameSeal:
    """Seals and opens the frames of engine messages with one task's key (AES-256-GCM)."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a task key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(bytes(key))

    @staticmethod
    def new_key() -> bytes:
        """A fresh random task key."""
        return AESGCM.generate_key(bit_length=256)

    def close(self, frames: Sequence[Any]) -> list[Any]:
        """The sealed frames of an encoded message (header first; the others are views of one buffer)."""
        views = [_view(f) for f in frames]
        if len(views) > MAX_FRAMES:
            raise ValueError(f"wire: at most {MAX_FRAMES} frames per sealed message")
        prefix = os.urandom(8)
        header = _HEAD.pack(MAGIC, VERSION, prefix, len(views)) + b"".join(_SIZE.pack(v.nbytes) for v in views)
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

    def open(self, frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_BYTES) -> list[Any]:
        """The frames that were sealed, once every chunk's tag checks; WireError otherwise."""
        if not frames:
            raise WireError("empty sealed message")
        header = bytes(_view(frames[0]))
        if len(header) < _HEAD.size:
            raise WireError("sealed message header is truncated")
        magic, version, prefix, count = _HEAD.unpack_from(header)
        if magic != MAGIC:
            raise WireError(f"bad magic {magic!r}: not a sealed meshlearn message")
        if version != VERSION:
            raise WireError(f"unsupported seal version {version} (this build speaks version {VERSION})")
        if count > MAX_FRAMES or len(header) != _HEAD.size + count * _SIZE.size:
            raise WireError("sealed message header does not match its frame count")
        sizes = [_SIZE.unpack_from(header, _HEAD.size + i * _SIZE.size)[0] for i in range(count)]
        if sum(sizes) > max_bytes:
            raise WireError(f"sealed message of {sum(sizes)} bytes exceeds the size cap of {max_bytes} bytes")
        if len(frames) - 1 != sum(len(_chunks(size)) for size in sizes):
            raise WireError("sealed message has the wrong number of chunks for its frame sizes")
        opened: list[Any] = []
        index = 1
        try:
            for size in sizes:
                plain = numpy.empty(size, numpy.uint8)  # every byte is written below: no zero-filling
                out = memoryview(plain).cast("B")
                for start in _chunks(size):
                    chunk = _view(frames[index])
                    length = min(CHUNK, size - start)
                    if chunk.nbytes != length + TAG:
                        raise WireError(f"chunk {index} holds {chunk.nbytes} bytes, the header says {length + TAG}")
                    self._aead.decrypt_into(prefix + index.to_bytes(4, "big"), chunk, header,
                                            out[start:start + length])
                    index += 1
                opened.append(plain)
        except InvalidTag:
            raise WireError("message is not sealed with this task's key (forged, damaged, or from another "
                            "task)") from None
        return opened


def encode_for(msg: Message, secret: bytes | None, seal: FrameSeal | None) -> list:
    """``encode``, then sealed if the endpoint has a seal."""
    frames = encode(msg, secret)
    return seal.close(frames) if seal is not None else frames


def decode_for(frames: Sequence[Any], max_bytes: int, secret: bytes | None, seal: FrameSeal | None) -> Message:
    """Opened if the endpoint has a seal (refused if it does not open), then ``decode``."""
    if seal is not None:
        frames = seal.open(frames, max_bytes)
    return decode(frames, max_bytes, secret)
