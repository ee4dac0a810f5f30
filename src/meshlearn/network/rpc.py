"""Request/reply between network services over ZeroMQ, every message signed (``envelope``).

A server binds one ROUTER socket; handlers run on a small thread pool so a slow handler (the
leader waiting for the first round of models) never stalls the others. A client opens a fresh
DEALER per call with a deadline, so a dead peer costs one timeout and leaves nothing behind.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import zmq

from meshlearn.errors import (
    AuthError,
    BadMessage,
    NetworkError,
    PortInUseError,
    RemoteError,
    Unreachable,
    UserInputError,
)
from meshlearn.network.envelope import Envelope, ReplayGuard, seal, unseal
from meshlearn.threads import GuardedThread

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
RECEIVE_QUEUE = 8  # whole messages ZeroMQ holds per connection before it stops reading that socket
__all__ = ["RemoteError", "RpcServer", "Unreachable", "call", "parse_address"]
Handler = Callable[[Envelope], tuple[dict, list] | dict]


class RpcServer:
    """Serves signed requests on ``tcp://host:port``; ``handlers`` maps a message kind to a function.

    A handler returns a reply body (or body and blobs); raising NetworkError or ValueError sends
    the message back as a refusal. Unsigned, oversized or malformed requests are answered with a
    refusal and counted, never crash the server.
    """

    def __init__(self, name: str, host: str, port: int, secret: bytes, handlers: dict[str, Handler],
                 max_bytes: int = DEFAULT_MAX_BYTES, workers: int = 16):
        self.name, self.host, self.port = name, host, port
        self.secret = secret
        self.handlers = dict(handlers)
        self.max_bytes = max_bytes
        self.workers = workers
        self.rejected = 0
        self._replays = ReplayGuard()
        self._rejected_from: dict[str, int] = {}  # refusals by peer address (for the log)
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_address = f"inproc://rpc-wake-{id(self)}"
        self._local = threading.local()
        self._stop = threading.Event()
        self._socket: zmq.Socket | None = None
        self._thread: GuardedThread | None = None

    def bind(self) -> int:
        """Bind the socket (port 0 picks a free one) and return the port."""
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        try:
            if self.port:
                sock.bind(f"tcp://{self.host}:{self.port}")
            else:
                self.port = sock.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError as exc:
            sock.close()
            if exc.errno == zmq.EADDRINUSE:
                raise PortInUseError(f"port {self.port} on {self.host} is in use") from None
            raise NetworkError(f"cannot listen on {self.host}:{self.port}: {exc.strerror}") from None
        self._socket = sock
        return self.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        """Serve in a background thread (binding first if needed)."""
        if self._socket is None:
            self.bind()
        self._thread = GuardedThread(self.serve, f"rpc-{self.name}")
        self._thread.start()

    def check(self) -> None:
        """Raise ``ThreadFailed`` if the serving thread died (the service must end, not run on deaf)."""
        if self._thread is not None:
            self._thread.raise_if_failed()

    def serve(self) -> None:
        """Serve until ``stop()``; the socket is used by this thread only."""
        if self._socket is None:
            self.bind()
        sock = self._socket
        wake = zmq.Context.instance().socket(zmq.PULL)
        wake.bind(self._wake_address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        with ThreadPoolExecutor(self.workers, thread_name_prefix=f"{self.name}-h",
                                initializer=self._open_waker) as pool:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if wake in events:
                    while True:
                        try:
                            wake.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                if sock in events:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        request = self._admit(sock, frames[0].bytes, frames[1:], _peer_address(frames[-1]))
                        if request is not None:
                            pool.submit(self._handle, frames[0].bytes, request)
                while True:
                    try:
                        identity, reply = self._replies.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        sock.send_multipart([identity, *reply], copy=False)
                    except zmq.ZMQError as exc:
                        log.debug("%s: reply not sent: %s", self.name, exc)
        wake.close(0)
        sock.close(0)
        self._socket = None

    def _open_waker(self) -> None:
        """Each handler thread gets its own socket to wake the serving loop when a reply is ready."""
        waker = zmq.Context.instance().socket(zmq.PUSH)
        waker.setsockopt(zmq.LINGER, 0)
        waker.connect(self._wake_address)
        self._local.waker = waker

    def _admit(self, sock: zmq.Socket, identity: bytes, frames: list, peer: str) -> Envelope | None:
        """The request, if it is signed, well formed and not a replay (checked here, in the serving
        thread, so nothing unsigned waits in the handlers' queue); else a refusal is sent."""
        try:
            request = unseal(frames, self.secret, self.max_bytes)
            self._replays.check(request)
            return request
        except (AuthError, BadMessage) as exc:
            self.rejected += 1
            count = self._rejected_from[peer] = self._rejected_from.get(peer, 0) + 1
            if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... from one address: a retry loop is not a flood
                log.warning("%s: rejected a request from %s (%d so far from there): %s", self.name, peer, count, exc)
            # the request's id is unknown: an empty id tells the caller (one socket per call) it was refused
            refusal = Envelope("error", {"error": f"{self.name} rejected the request: {exc}"}, msg_id="",
                               sender=self.name)
            try:
                sock.send_multipart([identity, *seal(refusal, self.secret)], copy=False)
            except zmq.ZMQError as send_error:
                log.debug("%s: refusal not sent: %s", self.name, send_error)
            return None

    def _handle(self, identity: bytes, request: Envelope) -> None:
        handler = self.handlers.get(request.kind)
        if handler is None:
            self.rejected += 1
            reply = Envelope("error", {"error": f"{self.name} does not serve {request.kind!r}"})
        else:
            try:
                result = handler(request)
                body, blobs = result if isinstance(result, tuple) else (result, [])
                reply = Envelope("ok", body, blobs)
            except (NetworkError, ValueError, KeyError, TypeError) as exc:
                reply = Envelope("error", {"error": str(exc) or type(exc).__name__})
            except Exception as exc:  # a handler bug must not take the service down
                log.exception("%s: handler for %s failed", self.name, request.kind)
                reply = Envelope("error", {"error": f"{self.name} failed on {request.kind}: {exc}"})
        reply.msg_id = request.msg_id
        reply.sender = self.name
        self._reply(identity, reply)

    def _reply(self, identity: bytes, reply: Envelope) -> None:
        self._replies.put((identity, seal(reply, self.secret)))
        self._local.waker.send(b"", zmq.NOBLOCK)

    def stop(self) -> None:
        """Stop serving and close the socket (joins the serving thread if there is one)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        elif self._socket is not None:  # bound, never served
            self._socket.close(0)
            self._socket = None


def call(address: str, kind: str, body: dict | None, secret: bytes, *, blobs: list | None = None,
         timeout: float = 10.0, sender: str = "", max_bytes: int = DEFAULT_MAX_BYTES) -> Envelope:
    """Send one request to ``host:port`` and return the reply; raise Unreachable, RemoteError or AuthError."""
    request = Envelope(kind, body or {}, list(blobs or []), sender)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart(seal(request, secret), copy=False)
        deadline_ms = int(timeout * 1000)
        while sock.poll(deadline_ms, zmq.POLLIN):
            frames = sock.recv_multipart(copy=False)
            try:
                reply = unseal(frames, secret, max_bytes)
            except AuthError:
                raise AuthError(f"{address} answered {kind} without this network's signature: "
                                "it uses a different secret") from None
            if reply.msg_id not in (request.msg_id, ""):
                continue
            if reply.kind == "error":
                raise RemoteError(str(reply.body.get("error", "refused")))
            return reply
        raise Unreachable(f"no reply from {address} to {kind} within {timeout:g} s")
    finally:
        sock.close(0)


def parse_address(text: str, what: str = "address") -> str:
    """``host:port`` checked (port within 1..65535); raises UserInputError with a fix."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise UserInputError(f"{what} {text!r} is not HOST:PORT (e.g. 127.0.0.1:8080)")
    try:
        number = int(port)
    except ValueError:
        raise UserInputError(f"{what} {text!r}: port {port!r} is not a number") from None
    if not 1 <= number <= 65535:
        raise UserInputError(f"{what} {text!r}: port {number} is outside 1..65535")
    return f"{host}:{number}"


def _peer_address(frame: zmq.Frame) -> str:
    """The address a received message came from (ZeroMQ's metadata), for the log."""
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return "an unknown address"
