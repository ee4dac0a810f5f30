"""A reliable byte stream over a punched UDP path: QUIC (aioquic) on the very socket that punched
it, so the NAT mappings the punch made carry it.

Where two NATs let a UDP path through but no TCP one, the engines' ZeroMQ connections are carried
over QUIC streams the way the relay carries them over TCP (relay.py): on each side,
``expose_local(engine_port)`` returns a port on 127.0.0.1; a connection made to it (this side's
DEALER) becomes a stream to the peer, which connects it to its own engine's port (its ROUTER) and
copies bytes both ways. Both sides can open streams, whichever is QUIC's client or server.

Trust: each side makes an ephemeral certificate (``PathCertificate``) and sends its fingerprint
over the already authenticated control channel. aioquic verifies chains only, so neither side
asks it to (``verify_mode=CERT_NONE``): once the handshake is done, each side checks that the
certificate the other presented, whose key the handshake proved it holds, is the pinned one, and
closes the path otherwise. The server asks for the client's certificate, which aioquic can do
through its TLS context only (quicconn.py says how). Inside, engine messages are sealed end to
end with the task's key as over any other path.

The path runs in one thread (an asyncio loop); ``start()`` is back once the handshake is done and
the peer accepted this side, or raises with everything closed. Keep-alive PINGs keep the NAT's
mapping; a path with no packet from the peer for ``idle_timeout`` ends (``ended``, ``why``), and
with it every connection it carried.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading

from meshlearn.network.channel.quicconn import PathCertificate, certificate_fingerprint
from meshlearn.network.channel.quicsession import (
    PathSession,
    PathTimes,
    QuicHandshakeTimeout,
    QuicPathError,
    QuicPinMismatch,
)
from meshlearn.network.channel.quicstreams import LOOPBACK

__all__ = [
    "PathCertificate",
    "QuicHandshakeTimeout",
    "QuicPath",
    "QuicPathError",
    "QuicPinMismatch",
    "certificate_fingerprint",
    "role_for",
]

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0  # seconds start() waits for the handshake and the peer's acceptance
KEEPALIVE = 10.0  # seconds between PINGs: well inside the NATs' UDP mapping timeouts (30 s and more)
IDLE_TIMEOUT = 30.0  # seconds without a packet from the peer after which the path is over
CLOSE_TIME = 5.0  # seconds close() waits for the path's thread to end
FINGERPRINT_BYTES = 32  # SHA-256
ROLES = ("client", "server")


def role_for(own_key: bytes, peer_key: bytes) -> str:
    """The QUIC role of this side of a path between two participants, agreed without a word:
    the one with the smaller key is the client."""
    return "client" if own_key < peer_key else "server"


class QuicPath:
    """One QUIC connection over ``sock`` (a bound UDP socket, which the path takes over and closes)
    to ``peer`` (HOST, PORT), as ``role`` ("client" or "server"), presenting ``own`` and accepting
    only a peer whose certificate has the SHA-256 fingerprint ``peer_fingerprint``.
    ``sent_bytes``/``received_bytes`` count the bytes carried each way."""

    def __init__(self, sock: socket.socket, peer: tuple[str, int], role: str, own: PathCertificate,
                 peer_fingerprint: bytes, handshake_timeout: float = HANDSHAKE_TIMEOUT,
                 keepalive: float = KEEPALIVE, idle_timeout: float = IDLE_TIMEOUT):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        if not isinstance(peer_fingerprint, bytes) or len(peer_fingerprint) != FINGERPRINT_BYTES:
            raise QuicPathError(f"the peer's certificate fingerprint must be {FINGERPRINT_BYTES} bytes (SHA-256): "
                                "the control channel sent something else")
        self._sock = sock
        self._session = PathSession(sock, (peer[0], peer[1]), role == "client", own, peer_fingerprint,
                                    PathTimes(handshake_timeout, keepalive, idle_timeout))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None

    @property
    def sent_bytes(self) -> int:
        return self._session.carrier.sent_bytes

    @property
    def received_bytes(self) -> int:
        return self._session.carrier.received_bytes

    @property
    def keepalives(self) -> int:
        """Keep-alive PINGs the peer acknowledged."""
        return self._session.keepalives

    @property
    def ended(self) -> threading.Event:
        """Set once the path is over and everything it held is closed."""
        return self._session.ended

    @property
    def why(self) -> str:
        """Why the path ended ("" while it serves)."""
        return self._session.why

    def held_bytes(self) -> int:
        """Bytes this side holds in memory for the connections it carries (0 once it ended)."""
        if self._thread is None or not self._thread.is_alive():
            return 0
        asked: concurrent.futures.Future[int] = concurrent.futures.Future()
        if not self._call(lambda: asked.set_result(self._session.carrier.held_bytes())):
            return 0
        try:
            return asked.result(CLOSE_TIME)
        except concurrent.futures.TimeoutError:  # the loop ended meanwhile
            return 0

    def start(self) -> None:
        """Run the path's thread and open the path: back once the peer proved the pinned
        certificate and accepted this side's. Raises QuicHandshakeTimeout, QuicPinMismatch or
        QuicPathError otherwise, with the thread stopped and the socket closed."""
        if self._thread is not None or self._session.ended.is_set():
            raise RuntimeError("a QuicPath starts once, and not once closed: make a new one")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="quic-path", daemon=True)
        self._thread.start()
        try:
            self._session.ready.result(timeout=self._session.times.handshake + CLOSE_TIME)
        except BaseException:
            self.close()
            raise

    def expose_local(self, port: int | None, host: str = LOOPBACK) -> int:
        """Carry streams the peer opens to ``port`` on ``host`` (an address of this machine where
        the engine listens; None: refuse them), and return a
        port on 127.0.0.1 whose connections are carried to the peer's. Call it before the peer's
        side connects (before ``start()`` will do): streams that come earlier are refused."""
        if self._listener is not None:
            raise RuntimeError("expose_local() is called once per path")
        self._listener = socket.create_server((LOOPBACK, 0))
        local_port = self._listener.getsockname()[1]
        if self._thread is None:
            self._session.carrier.expose(port, self._listener, host)
        elif not self._call(self._session.carrier.expose, port, self._listener, host):
            self._listener.close()
        return local_port

    def close(self) -> None:
        """End the path (the peer is told), close every connection it carried and its sockets, and
        stop its thread (back when it has stopped). Safe to call at any time, more than once."""
        if self._thread is None:
            self._session.ended.set()
            self._sock.close()
            if self._listener is not None:
                self._listener.close()
            return
        self._call(self._session.finish, "closed by this side")
        self._thread.join(CLOSE_TIME)
        if self._thread.is_alive():
            log.warning("the QUIC path to %s did not stop within %g s", self._session.where, CLOSE_TIME)

    def _call(self, function, *args) -> bool:
        """Have the path's loop call ``function(*args)``; False if the loop is over."""
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop is closed: the path ended by itself
            return False
        return True

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._session.run())
        finally:
            rest = asyncio.all_tasks(loop)
            for task in rest:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
            if self._listener is not None:  # exposed as the path ended: never served
                self._listener.close()
            self._session.ended.set()
