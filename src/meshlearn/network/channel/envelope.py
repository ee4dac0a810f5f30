"""Signed control messages: a JSON header, raw binary blobs, and an HMAC-SHA256 over all of them.

Nothing in a message is ever unpickled, evaluated or imported: the header is JSON (a dict of
plain values), blobs are bytes the receiver decodes with a validating codec (models go through
``meshlearn.wire``). A message whose signature does not match the network secret is rejected
before its header is even parsed.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from meshlearn.errors import AuthError, BadMessage, NetworkError, UserInputError
from meshlearn.network.channel.identity import key_text
from meshlearn.wire.auth import frames_mac, mac_matches

VERSION = 1
MAX_HEADER_BYTES = 1024 * 1024
MAX_BLOBS = 4096
MAX_CLOCK_SKEW = 600.0
MAX_FIELD_INT = 2**63 - 1  # the largest integer (either sign) a field holds: an int64's, a float's without overflow
SECRET_ENV = "MESHLEARN_SECRET"
__all__ = ["AuthError", "BadMessage", "Envelope", "NetworkError", "field_of", "resolve_secret", "seal", "unseal"]


@dataclass
class Envelope:
    """One control message: who sent it, what kind, a JSON body and binary blobs."""

    kind: str
    body: dict[str, Any] = field(default_factory=dict)
    blobs: list[Any] = field(default_factory=list)
    sender: str = ""
    msg_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    sent_at: float = field(default_factory=time.time)
    peer_key: bytes | None = None  # the sender's public key, proven by the encrypted channel it came over
    peer_address: str = ""  # the IP address the request came from, as the server saw it

    @property
    def caller(self) -> str:
        """The key the request's channel proved, as printed ("" where none did: plain ZeroMQ)."""
        return key_text(self.peer_key) if self.peer_key is not None else ""


def resolve_secret(secret: str | None = None, secret_file: str | None = None) -> bytes:
    """The network secret from a flag, a file, or ``$MESHLEARN_SECRET``, at least 8 characters."""
    if secret_file:
        path = Path(secret_file)
        if not path.is_file():
            raise UserInputError(f"secret file {path} does not exist: give the file holding the network secret")
        secret = path.read_text().strip()
    secret = secret if secret is not None else os.environ.get(SECRET_ENV)
    if not secret:
        raise UserInputError(
            f"no network secret: pass --secret, --secret-file or set {SECRET_ENV} (the same on every machine)")
    if len(secret) < 8:
        raise UserInputError("the network secret is too short: use at least 8 characters")
    return secret.encode()


def seal(envelope: Envelope, secret: bytes, header_only: bool = False) -> list[Any]:
    """Frames for the wire: header, blobs (as given, not copied), signature. Over an encrypted,
    authenticated channel (``header_only``) the signature covers the header alone: it proves the
    network secret, the channel already guarantees every byte of the blobs."""
    blobs = [memoryview(b).cast("B") for b in envelope.blobs]
    header = json.dumps({
        "v": VERSION, "kind": envelope.kind, "from": envelope.sender, "id": envelope.msg_id,
        "ts": envelope.sent_at, "body": envelope.body, "blobs": [len(b) for b in blobs],
    }, separators=(",", ":")).encode()
    frames: list[Any] = [header, *blobs]
    return frames + [frames_mac(secret, frames[:1] if header_only else frames)]


def unseal(frames: Sequence[Any], secret: bytes, max_bytes: int, header_only: bool = False) -> Envelope:
    """Verify and decode frames into an Envelope; raise AuthError or BadMessage on anything wrong
    (``header_only``: as ``seal``, for frames that came over an encrypted, authenticated channel)."""
    if len(frames) < 2:
        raise BadMessage(f"a message needs a header and a signature, got {len(frames)} frame(s)")
    if len(frames) - 2 > MAX_BLOBS:
        raise BadMessage(f"too many blobs ({len(frames) - 2} > {MAX_BLOBS})")
    views = [memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B") for f in frames]
    total = sum(len(v) for v in views)
    if total > max_bytes:
        raise BadMessage(f"message of {total} bytes is over the {max_bytes}-byte cap")
    if not mac_matches(secret, views[:1] if header_only else views[:-1], views[-1]):
        raise AuthError("message signature does not match: the sender does not hold this network's secret")
    if len(views[0]) > MAX_HEADER_BYTES:
        raise BadMessage(f"header of {len(views[0])} bytes is over the {MAX_HEADER_BYTES}-byte cap")
    try:
        header = json.loads(bytes(views[0]))
    except (ValueError, RecursionError):  # ValueError: UnicodeDecodeError, JSONDecodeError, a number of 4,300 digits
        raise BadMessage("header is not valid JSON") from None
    if not isinstance(header, dict):
        raise BadMessage("header is not a JSON object")
    if header.get("v") != VERSION:
        raise BadMessage(f"protocol version {header.get('v')!r} is not supported (this is version {VERSION})")
    kind, body, sizes = header.get("kind"), header.get("body"), header.get("blobs")
    sender, msg_id, sent_at = header.get("from"), header.get("id"), header.get("ts")
    if not isinstance(kind, str) or not isinstance(body, dict) or not isinstance(sender, str) \
            or not isinstance(msg_id, str) or not isinstance(sent_at, (int, float)) or not isinstance(sizes, list):
        raise BadMessage("header lacks kind, body, from, id, ts or blobs, or has them of the wrong type")
    sent_at = math.nan if isinstance(sent_at, bool) else _as_float(sent_at)
    if not math.isfinite(sent_at) or abs(time.time() - sent_at) > MAX_CLOCK_SKEW:
        raise BadMessage(f"message timestamp is {time.time() - sent_at:.0f} s off: replayed, or clocks far apart")
    blobs = views[1:-1]
    if sizes != [len(b) for b in blobs]:
        raise BadMessage("blob sizes in the header do not match the frames received")
    return Envelope(kind, body, list(blobs), sender, msg_id, sent_at)


def _as_float(number: float) -> float:
    """``number`` as a float; infinity for a JSON integer too large for one (of its sign)."""
    try:
        return float(number)
    except OverflowError:
        return math.inf if number > 0 else -math.inf


class ReplayGuard:
    """Makes each signed request single-use: a message id seen before, within the timestamp window,
    is a replay (``unseal`` refuses what is outside the window). Ids are forgotten once their
    timestamp leaves the window, so memory is bounded by the rate of genuine requests."""

    def __init__(self, window: float = MAX_CLOCK_SKEW, clock: Callable[[], float] = time.time):
        self.window = window
        self.clock = clock
        self._seen: dict[str, float] = {}
        self._next_sweep = 0.0
        self.replays = 0

    def check(self, envelope: Envelope) -> None:
        """Raise BadMessage if ``envelope``'s id was already accepted; remember it otherwise."""
        now = self.clock()
        if now >= self._next_sweep:
            self._seen = {msg_id: ts for msg_id, ts in self._seen.items() if abs(now - ts) <= self.window}
            self._next_sweep = now + self.window / 10
        if envelope.msg_id in self._seen:
            self.replays += 1
            raise BadMessage(f"message {envelope.msg_id[:12]} was already received: a replay")
        self._seen[envelope.msg_id] = envelope.sent_at


def field_of(body: dict, key: str, kind: type | tuple[type, ...], default: Any = ..., *,
             min_value: float | None = None, max_len: int = 4096) -> Any:
    """``body[key]`` checked for type, bounds and length; BadMessage names the field otherwise."""
    if key not in body:
        if default is ...:
            raise BadMessage(f"field {key!r} is missing")
        return default
    value = body[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise BadMessage(f"field {key!r} must be {kind}, not a boolean")
    if not isinstance(value, kind):
        raise BadMessage(f"field {key!r} has the wrong type ({type(value).__name__})")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_FIELD_INT:
        raise BadMessage(f"field {key!r} is out of range (at most {MAX_FIELD_INT} either way)")
    if min_value is not None and isinstance(value, (int, float)) and not value >= min_value:  # NaN is not
        raise BadMessage(f"field {key!r} must be at least {min_value}")
    if isinstance(value, (str, list, dict)) and len(value) > max_len:
        raise BadMessage(f"field {key!r} is too long ({len(value)} > {max_len})")
    return value
