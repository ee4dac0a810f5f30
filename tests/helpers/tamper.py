"""A TCP proxy in front of one node's engine endpoint that tampers with the messages passing it,
as someone on the path could, while keeping ZeroMQ's framing valid (ZMTP 3.x), so that what
reaches the node is a well-framed message that does not open, or an old one played again.

ZMTP 3.x on the wire, each way: a 64-byte greeting (passed on as it comes: libzmq sends it in
parts and waits for the other side's), then frames: a flags byte (MORE 1, LONG 2, COMMAND 4), the
body's length (1 byte, or 8 bytes big-endian when LONG), the body. Commands (the NULL mechanism's
READY, heartbeats) pass untouched; a message is the frames up to one without MORE.

Kinds of tampering, on a message of at least ``min_bytes`` (4096: a model, not a ping):

- ``flip``: one bit of a sealed chunk (a frame after the seal header);
- ``truncate``: a chunk cut to half its length (its length field rewritten to match);
- ``swap``: two chunk frames exchanged;
- ``header``: one byte of the seal header (frame 0) changed;
- ``garbage``: every frame replaced by random bytes of the same length;
- ``replay``: the connection's first such message recorded, and copies of it played into the same
  connection later (after every ``every``-th such message), ``copies`` times in all.

The other kinds tamper with every ``every``-th such message, ``limit`` times in all, in the
directions asked: ``TO_NODE`` (what the node's peers send it) and ``FROM_NODE`` (its answers).
"""

from __future__ import annotations

import random
import socket
import struct
import threading
from dataclasses import dataclass, field

GREETING = 64
MORE, LONG, COMMAND = 1, 2, 4
TO_NODE, FROM_NODE = "to node", "from node"
_LENGTH = struct.Struct(">Q")


@dataclass
class Frame:
    """One ZMTP frame: its flags and body."""

    flags: int
    body: bytes

    def wire(self) -> bytes:
        """The frame as ZMTP writes it (the LONG flag set by the body's length)."""
        flags = self.flags & ~LONG
        if len(self.body) > 255:
            return bytes([flags | LONG]) + _LENGTH.pack(len(self.body)) + self.body
        return bytes([flags, len(self.body)]) + self.body


class _Reader:
    """Reads a socket's byte stream in the pieces ZMTP needs; EOFError when the socket is done."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = bytearray()

    def some(self, limit: int) -> bytes:
        if not self.buffer:
            self._fill()
        taken = bytes(self.buffer[:limit])
        del self.buffer[:limit]
        return taken

    def exact(self, count: int) -> bytes:
        while len(self.buffer) < count:
            self._fill()
        taken = bytes(self.buffer[:count])
        del self.buffer[:count]
        return taken

    def frame(self) -> Frame:
        flags = self.exact(1)[0]
        length = _LENGTH.unpack(self.exact(8))[0] if flags & LONG else self.exact(1)[0]
        return Frame(flags, self.exact(length))

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            raise EOFError
        self.buffer += chunk


@dataclass
class Tampering:
    """What the proxy does to the messages of one direction, and what it did (shared by its connections)."""

    kind: str
    every: int
    limit: int
    copies: int
    min_bytes: int
    rng: random.Random
    seen: int = 0  # messages of at least min_bytes
    tampered: int = 0
    injected: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, message: list[Frame], recorded: list[list[Frame]]) -> list[list[Frame]]:
        """The messages to pass on for ``message`` (``recorded``: this connection's first large
        message, for ``replay``)."""
        if sum(len(frame.body) for frame in message) < self.min_bytes:
            return [message]
        with self._lock:
            self.seen += 1
            due = self.seen % self.every == 0
            if self.kind == "replay":
                if not recorded:
                    recorded.append([Frame(f.flags, f.body) for f in message])
                    return [message]
                if not due or self.injected >= self.copies:
                    return [message]
                self.injected += 1
                return [message, recorded[0]]
            if not due or self.tampered >= self.limit or len(message) < (3 if self.kind == "swap" else 2):
                return [message]  # (a sealed message has a header and a chunk at least; a swap needs two chunks)
            self.tampered += 1
            return [self._damage(message)]

    def _damage(self, message: list[Frame]) -> list[Frame]:
        frames = [Frame(f.flags, f.body) for f in message]
        DAMAGE[self.kind](frames, self.rng)
        return frames


def _flip(frames: list[Frame], rng: random.Random) -> None:
    chunk = rng.randrange(1, len(frames))
    body = bytearray(frames[chunk].body)
    bit = rng.randrange(len(body) * 8)
    body[bit // 8] ^= 1 << bit % 8
    frames[chunk].body = bytes(body)


def _truncate(frames: list[Frame], rng: random.Random) -> None:
    chunk = rng.randrange(1, len(frames))
    frames[chunk].body = frames[chunk].body[:len(frames[chunk].body) // 2]


def _swap(frames: list[Frame], rng: random.Random) -> None:
    one, other = rng.sample(range(1, len(frames)), 2)
    frames[one].body, frames[other].body = frames[other].body, frames[one].body


def _header(frames: list[Frame], rng: random.Random) -> None:
    body = bytearray(frames[0].body)
    body[rng.randrange(len(body))] ^= rng.randrange(1, 256)
    frames[0].body = bytes(body)


def _garbage(frames: list[Frame], rng: random.Random) -> None:
    for frame in frames:
        frame.body = rng.randbytes(len(frame.body))


DAMAGE = {"flip": _flip, "truncate": _truncate, "swap": _swap, "header": _header, "garbage": _garbage}
KINDS = (*DAMAGE, "replay")


class TamperProxy:
    """Listens on a free loopback port and passes every connection on to ``target``
    (``tcp://HOST:PORT``), tampering as ``kind`` says. Use as a context manager, or ``close()``."""

    def __init__(self, target: str, kind: str, *, every: int = 5, limit: int = 3, copies: int = 17,
                 min_bytes: int = 4096, directions: tuple[str, ...] = (TO_NODE, FROM_NODE), seed: int = 0):
        if kind not in KINDS:
            raise ValueError(f"unknown kind of tampering {kind!r}; known: {', '.join(KINDS)}")
        host, _, port = target.removeprefix("tcp://").rpartition(":")
        self.target = (host, int(port))
        rng = random.Random(seed)
        self.tampering = {direction: Tampering(kind, every, limit, copies, min_bytes, random.Random(rng.random()))
                          for direction in directions}
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._pumps: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="tamper-accept", daemon=True)
        self._acceptor.start()

    @property
    def tampered(self) -> int:
        """Messages damaged so far, both ways."""
        return sum(t.tampered for t in self.tampering.values())

    @property
    def injected(self) -> int:
        """Copies played again so far, both ways."""
        return sum(t.injected for t in self.tampering.values())

    def close(self) -> None:
        """Stop listening, cut every connection, and wait for the proxy's threads."""
        with self._lock:
            self._closed = True
        _shut(self._listener)
        self._listener.close()
        self._acceptor.join(timeout=5)
        for sock in self._sockets:  # no new ones now
            _shut(sock)
        for thread in self._pumps:
            thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()

    def __enter__(self) -> "TamperProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                node = socket.create_connection(self.target, timeout=5)
            except OSError:  # the node is gone: so is this client
                client.close()
                continue
            node.settimeout(None)
            with self._lock:
                if self._closed:
                    client.close()
                    node.close()
                    return
                self._sockets += [client, node]
                for source, sink, direction in ((client, node, TO_NODE), (node, client, FROM_NODE)):
                    pump = threading.Thread(target=self._pump, args=(source, sink, self.tampering.get(direction)),
                                            name=f"tamper-{direction}", daemon=True)
                    self._pumps.append(pump)
                    pump.start()

    def _pump(self, source: socket.socket, sink: socket.socket, tampering: Tampering | None) -> None:
        """Pass one direction of a connection on, tampering with its messages, until either side closes."""
        reader = _Reader(source)
        recorded: list[list[Frame]] = []
        try:
            passed = 0
            while passed < GREETING:
                piece = reader.some(GREETING - passed)
                sink.sendall(piece)
                passed += len(piece)
            message: list[Frame] = []
            while True:
                frame = reader.frame()
                if frame.flags & COMMAND:
                    sink.sendall(frame.wire())
                    continue
                message.append(frame)
                if frame.flags & MORE:
                    continue
                out = tampering.take(message, recorded) if tampering is not None else [message]
                sink.sendall(b"".join(f.wire() for m in out for f in m))
                message = []
        except (EOFError, OSError):
            pass
        for sock in (source, sink):  # one side is done: so is the connection
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Shut a socket both ways (waking a thread blocked on it), if it is still open."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
