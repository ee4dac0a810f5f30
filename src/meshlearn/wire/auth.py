"""Message authentication with a shared secret: HMAC-SHA256 over a message's frames.

Each frame is prefixed with its length before hashing, so moving bytes between frames changes
the code. Used by the codec (signed model messages) and the network's control messages.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Sequence

MAC_BYTES = 32


def frames_mac(secret: bytes, frames: Sequence[Any]) -> bytes:
    """The HMAC-SHA256 of ``frames`` (bytes-like, zmq frames' buffers) under ``secret``."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        view = memoryview(frame).cast("B")
        mac.update(len(view).to_bytes(8, "little"))
        mac.update(view)
    return mac.digest()


def mac_matches(secret: bytes, frames: Sequence[Any], mac: Any) -> bool:
    """Whether ``mac`` is the code of ``frames`` under ``secret`` (constant-time comparison)."""
    mac = bytes(memoryview(mac).cast("B"))
    return len(mac) == MAC_BYTES and hmac.compare_digest(mac, frames_mac(secret, frames))

