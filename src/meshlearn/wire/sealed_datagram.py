"""Sealed UDP datagrams: each datagram of a network task's UDP transport sealed on its own with the
task's key (AES-256-GCM, ``cryptography``), so it can be lost, late or reordered alone.

Layout: the datagram's header in the clear (``wire.datagram``: who sent it, which chunk of which
message, its checksum over the header and the plain payload), then::

    nonce (12 bytes: the sealer's random 8-byte prefix || its datagram counter u32)
    | the payload, encrypted | tag (16 bytes)

The header and the nonce are the associated data: a header changed on the way (another chunk
index, another sender) fails the tag as surely as a changed payload. Each ``DatagramSeal`` draws
its prefix once and counts its datagrams, so no nonce repeats under one key while it lives (at
most 2^32 datagrams: it refuses to seal more), and two seals of one key share a prefix with
probability 2^-64.

Freshness: ``DatagramWindow`` takes each (sender, counter) once, within a window of counters
below the sender's newest (datagrams overtake each other on the way); a sender's datagrams must
all carry the prefix of its first authentic one, so a datagram played again from another of
its sessions is refused too. Authentic means sealed with this run's key: a network task draws a
key for every run (``wire.sealed``), so a datagram of an earlier run, played before a sender's
first one, does not open and cannot set that sender's session. Nothing is decrypted into the
model before the tag checks.
"""

from __future__ import annotations

import os
import threading

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from meshlearn.errors import WireError
from meshlearn.wire.sealed import KEY_BYTES, ReplayWindow, Stamp

NONCE = 12
PREFIX = 8
TAG = 16
OVERHEAD = NONCE + TAG  # bytes a sealed datagram carries beyond its header and payload
MAX_COUNTER = (1 << 32) - 1
WINDOW = 1 << 16  # datagram counters remembered below a sender's newest: 65,536 (8 KB a sender)


class DatagramSeal:
    """Seals and opens datagrams with one task's key. Thread-safe."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a task key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(bytes(key))
        self.prefix = os.urandom(PREFIX)
        self._counter = 0
        self._lock = threading.Lock()

    def close(self, head: bytes, payload: bytes | memoryview) -> tuple[bytes, bytes]:
        """The nonce and the sealed payload (ciphertext and tag) of a datagram whose header is ``head``."""
        with self._lock:
            if self._counter >= MAX_COUNTER:
                raise WireError("this seal has sealed 2^32 datagrams: a new one (a new task run) is needed")
            self._counter += 1
            counter = self._counter
        nonce = self.prefix + counter.to_bytes(NONCE - PREFIX, "big")
        return nonce, self._aead.encrypt(nonce, bytes(payload), bytes(head) + nonce)

    def open(self, head: memoryview, body: memoryview, out: memoryview) -> tuple[bytes, int]:
        """Check and decrypt a datagram's ``body`` (nonce, ciphertext, tag) under its header ``head``
        into ``out`` (exactly the payload's size); its nonce's prefix and counter. WireError if it
        does not open: forged, damaged, or sealed with another key."""
        if len(body) != len(out) + OVERHEAD:
            raise WireError(f"a sealed datagram of {len(body)} bytes after its header cannot hold a "
                            f"{len(out)}-byte payload")
        nonce = bytes(body[:NONCE])
        try:
            self._aead.decrypt_into(nonce, body[NONCE:], bytes(head) + nonce, out)
        except InvalidTag:
            raise WireError("datagram is not sealed with this task's key (forged, damaged, or from another "
                            "task or another run of it)") from None
        return nonce[:PREFIX], int.from_bytes(nonce[PREFIX:], "big")


class DatagramWindow:
    """The sealed datagrams one receiver has taken: per sender, the prefix of its first authentic
    datagram and a sliding window of its counters (``ReplayWindow``, as sealed messages have)."""

    def __init__(self, size: int = WINDOW):
        self._counters = ReplayWindow(size)
        self._prefixes: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def admit(self, sender: int, prefix: bytes, counter: int) -> str | None:
        """Take the datagram if it is fresh (None); otherwise say why not, and record nothing."""
        with self._lock:
            known = self._prefixes.setdefault(sender, prefix)
        if known != prefix:
            return f"sender {sender}'s datagram comes from another of its sessions"
        return self._counters.admit(Stamp(sender, counter))
