"""Request/reply between network services over ZeroMQ, every message signed (``envelope``).

A server binds one ROUTER socket; handlers run on a small thread pool so a slow handler (the
leader waiting for the first round of models) never stalls the others. A client opens a fresh
DEALER per call with a deadline, so a dead peer costs one timeout and leaves nothing behind.

With a key pair the server speaks CurveZMQ only: every connection is encrypted, the client
proves its key in the handshake (the server's ``admit`` decides, per new connection, through
ZeroMQ's ZAP), and a client calls ``HOST:PORT@KEY`` to talk only to the holder of ``KEY``.

Both ends state their protocol version at each connection's handshake (``handshake``): a server
refuses a request of another version, a client the reply of another version, in one line each.

Out of descriptors or memory, a server stops listening for a moment and says so in one line
(``accepting``): ZeroMQ itself would retry the failed accept() at once, a core spinning for as
long as the shortage lasts.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from meshlearn.accepting import ACCEPT_PAUSE, SHORTAGE, say_paused
from meshlearn.errors import (
    AuthError,
    BadMessage,
    KeyMismatch,
    KeyRefused,
    NetworkError,
    PortInUseError,
    RemoteError,
    ServiceUnavailable,
    Unreachable,
    UserInputError,
)
from meshlearn.network.channel import handshake
from meshlearn.network.channel.envelope import Envelope, ReplayGuard, seal, unseal
from meshlearn.network.channel.identity import (
    KeyPair,
    key_text,
    own_identity,
    peer_key,
    split_pinned,
)
from meshlearn.sparselog import SparseLog
from meshlearn.threads import GuardedThread
from meshlearn.transport.zmqsock import make_curve_client, make_curve_server

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
RECEIVE_QUEUE = 8  # whole messages ZeroMQ holds per connection before it stops reading that socket
HANDSHAKE_MS = 5000  # a connection that has not finished its encrypted handshake by then is dropped (ZeroMQ: 30 s)
HANDSHAKE_TRIES = 3  # failed handshakes in a row before a call gives up (a relay may cut one connection)
REFUSED_TRIES, REFUSED_FOR = 3, 1.0  # connections refused, for at least this long, before a call gives up
__all__ = ["RemoteError", "RpcServer", "Unreachable", "call", "parse_address"]
Handler = Callable[[Envelope], tuple[dict, list] | dict]
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_CONNECTION_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
POLL_MS = 100  # the serving loop's longest wait, so that stop() and a paused listener are seen soon


class RpcServer:
    """Serves signed requests on ``tcp://host:port``; ``handlers`` maps a message kind to a function.

    A handler returns a reply body (or body and blobs); raising NetworkError or ValueError sends
    the message back as a refusal. Unsigned, oversized or malformed requests are answered with a
    refusal and counted, never crash the server.
    """

    def __init__(self, name: str, host: str, port: int, secret: bytes, handlers: dict[str, Handler],
                 max_bytes: int = DEFAULT_MAX_BYTES, workers: int = 16, keys: KeyPair | None = None,
                 admit: Callable[[bytes], bool] | None = None, protocol: int | None = None):
        self.name, self.host, self.port = name, host, port
        self.protocol = handshake.PROTOCOL_VERSION if protocol is None else protocol  # stated at each handshake
        self.secret = secret
        self.keys = keys  # None: plain ZeroMQ (loopback tests and benchmarks only)
        self.admit = admit or (lambda key: True)
        self.handlers = dict(handlers)
        self.max_bytes = max_bytes
        self.workers = workers
        self.rejected = 0
        self.failed_handshakes = 0
        self.paused = 0  # times the server stopped listening for a moment, out of descriptors or memory
        self._endpoint = ""  # what the socket is bound to, to bind it again after a pause
        self._listen_at: float | None = None  # when a paused listener binds again (time.monotonic())
        self._replays = ReplayGuard()
        self._warn = SparseLog(log)  # refusals, by peer address or cause
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._waker: socket.socket | None = None  # handler threads write a byte to it when a reply is ready
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
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)  # a stranger holding a connection open costs little
        _state_version(sock, self.protocol)
        if self.keys is not None:
            make_curve_server(sock, self.keys.public, self.keys.secret, _zap_domain(self.name, self.admit))
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
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = sock
        return self.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def reached_at(self, host: str) -> str:
        """``HOST:PORT@KEY`` that clients call (``HOST:PORT`` without a key pair)."""
        address = f"{host}:{self.port}"
        return address if self.keys is None else f"{address}@{self.keys.text}"

    def bind_any(self) -> int | None:
        """Bind the asked port or, where it is in use, a free one (as the CloudMesh report asks);
        returns the asked port when it had to take another, else None."""
        try:
            self.bind()
            return None
        except PortInUseError:
            wanted, self.port = self.port, 0
            self.bind()
            return wanted

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
        # one pair made once, not a ZeroMQ socket per handler thread: a thread started while the process
        # is out of descriptors would fail to open its own, and break the handlers' pool for good
        wake, self._waker = socket.socketpair()
        wake.setblocking(False)
        self._waker.setblocking(False)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        # failed CurveZMQ handshakes are logged (they never reach _admit); a failed accept() pauses the listener
        monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPT_FAILED | (_HANDSHAKE_FAILED if self.keys is not None else 0))
        poller.register(monitor, zmq.POLLIN)
        with ThreadPoolExecutor(self.workers, thread_name_prefix=f"{self.name}-h") as pool:
            while not self._stop.is_set():
                events = dict(poller.poll(self._poll_ms()))
                if wake in events:
                    _drain(wake)
                if monitor in events:
                    self._read_monitor(sock, monitor)
                if self._listen_at is not None and time.monotonic() >= self._listen_at:
                    self._listen_again(sock)
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
        wake.close()
        self._waker.close()
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        self._socket = None

    def _poll_ms(self) -> int:
        """How long the serving loop may wait: POLL_MS, or less when a paused listener is due back."""
        if self._listen_at is None:
            return POLL_MS
        return max(0, min(POLL_MS, int((self._listen_at - time.monotonic()) * 1000) + 1))

    def _read_monitor(self, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        """Every event the monitor holds: a failed handshake is logged (not while paused: the
        handshakes cut then are the pause's own doing); accept() out of descriptors or memory pauses
        the listener."""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if self._listen_at is not None:
                continue
            if event["event"] != zmq.EVENT_ACCEPT_FAILED:
                self._log_failed_handshake(event)
            elif event["value"] in SHORTAGE:
                self._pause_listening(sock, event["value"])

    def _pause_listening(self, sock: zmq.Socket, error: int) -> None:
        """Close the listening socket for ACCEPT_PAUSE: libzmq retries a failed accept() at once
        for as long as the connection waits in the kernel's queue, a core spinning. The connections
        accepted through it close too (ZeroMQ's listener owns them), which gives their descriptors
        back; their callers see the call fail, newcomers are refused until it listens again."""
        try:
            sock.unbind(self._endpoint)
        except zmq.ZMQError as exc:
            log.debug("%s: cannot stop listening on %s: %s", self.name, self._endpoint, exc)
            return
        self.paused += 1
        say_paused(self.name, error, ACCEPT_PAUSE)
        self._listen_at = time.monotonic() + ACCEPT_PAUSE

    def _listen_again(self, sock: zmq.Socket) -> None:
        """Bind the paused listener again; still short (or the port not yet given back), another pause."""
        try:
            sock.bind(self._endpoint)
        except zmq.ZMQError as exc:
            if exc.errno not in SHORTAGE:
                self._warn.warning("listen again", "%s: cannot listen on %s again (%s): trying again in %g s",
                                   self.name, self._endpoint, exc.strerror, ACCEPT_PAUSE)
            self._listen_at = time.monotonic() + ACCEPT_PAUSE
            return
        self._listen_at = None

    def _log_failed_handshake(self, event: dict) -> None:
        self.failed_handshakes += 1
        why = ("its key is refused (revoked)" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else
               "it expected another server key, or replayed, truncated or garbled the handshake")
        self._warn.warning(f"handshake {why}", "%s: refused a connection: %s", self.name, why)

    def _admit(self, sock: zmq.Socket, identity: bytes, frames: list, peer: str) -> Envelope | None:
        """The request, if it is signed, well formed and not a replay (checked here, in the serving
        thread, so nothing unsigned waits in the handlers' queue); else a refusal is sent."""
        try:
            other = handshake.mismatch(self.protocol, _property(frames[-1], handshake.PROPERTY),
                                       _property(frames[-1], handshake.RELEASE_PROPERTY), f"the caller at {peer}",
                                       f"this {self.name}")
            if other is not None:
                raise BadMessage(str(other))
            request = unseal(frames, self.secret, self.max_bytes, header_only=self.keys is not None)
            self._replays.check(request)
            if self.keys is not None:
                request.peer_key = peer_key(_property(frames[-1], "User-Id"), "the client's key")
            request.peer_address = _property(frames[-1], "Peer-Address")
            return request
        except (AuthError, BadMessage) as exc:
            self.rejected += 1
            self._warn.warning(f"request from {peer}", "%s: rejected a request from %s: %s", self.name, peer, exc)
            # the request's id is unknown: an empty id tells the caller (one socket per call) it was refused
            refusal = Envelope("error", {"error": f"{self.name} rejected the request: {exc}"}, msg_id="",
                               sender=self.name)
            try:
                sock.send_multipart([identity, *seal(refusal, self.secret, self.keys is not None)], copy=False)
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
            except ServiceUnavailable as exc:  # the caller may ask another service of the kind
                reply = Envelope("error", {"error": str(exc), "unavailable": True})
            except (NetworkError, ValueError, KeyError, TypeError) as exc:
                reply = Envelope("error", {"error": str(exc) or type(exc).__name__})
            except Exception as exc:  # a handler bug must not take the service down
                log.exception("%s: handler for %s failed", self.name, request.kind)
                reply = Envelope("error", {"error": f"{self.name} failed on {request.kind}: {exc}"})
        reply.msg_id = request.msg_id
        reply.sender = self.name
        self._reply(identity, reply)

    def _reply(self, identity: bytes, reply: Envelope) -> None:
        self._replies.put((identity, seal(reply, self.secret, self.keys is not None)))
        try:
            self._waker.send(b"\0")
        except BlockingIOError:  # bytes the serving loop has not read yet wake it anyway
            pass

    def stop(self) -> None:
        """Stop serving and close the socket (joins the serving thread if there is one)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        elif self._socket is not None:  # bound, never served
            self._socket.close(0)
            self._socket = None


def call(address: str, kind: str, body: dict | None, secret: bytes, *, blobs: list | None = None,
         timeout: float = 10.0, sender: str = "", max_bytes: int = DEFAULT_MAX_BYTES,
         keys: KeyPair | None = None, protocol: int | None = None) -> Envelope:
    """Send one request to ``HOST:PORT@KEY`` (or plain ``HOST:PORT``) and return the reply; raise
    Unreachable, RemoteError, AuthError (another secret, another key, or this key refused) or
    ProtocolMismatch (the server speaks another protocol version than ``protocol``, by default this
    release's). The call proves ``keys`` (default: this process's, ``own_identity``)."""
    protocol = handshake.PROTOCOL_VERSION if protocol is None else protocol
    request = Envelope(kind, body or {}, list(blobs or []), sender)
    where, server_key = split_pinned(address)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    _state_version(sock, protocol)
    monitor = None
    try:
        if server_key is not None:
            me = keys or own_identity()
            make_curve_client(sock, me.public, me.secret, server_key)
        monitor = sock.get_monitor_socket(_CONNECTION_EVENTS | (_HANDSHAKE_FAILED if server_key is not None else 0))
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))  # a send with no connection to queue on ends
        started = time.monotonic()
        sock.connect(f"tcp://{where}")
        connection = _Connection()
        try:
            sock.send_multipart(seal(request, secret, server_key is not None), copy=False)
        except zmq.Again:  # what the connection saw says why (a key refused), else nothing took the request
            while monitor.poll(0):
                connection.saw(recv_monitor_message(monitor), where, server_key, kind, keys,
                               time.monotonic() - started)
            raise Unreachable(f"{kind} could not be sent to {where} within {timeout:g} s") from None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = started + timeout
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(left * 1000) + 1))
            if monitor in events:
                connection.saw(recv_monitor_message(monitor), where, server_key, kind, keys, time.monotonic() - started)
            if sock not in events:
                continue
            frames = sock.recv_multipart(copy=False)
            other = handshake.mismatch(protocol, _property(frames[-1], handshake.PROPERTY),
                                       _property(frames[-1], handshake.RELEASE_PROPERTY), where, "this client")
            if other is not None:
                raise other
            try:
                reply = unseal(frames, secret, max_bytes, header_only=server_key is not None)
            except AuthError:
                raise AuthError(f"{where} answered {kind} without this network's signature: "
                                "it uses a different secret") from None
            if reply.msg_id not in (request.msg_id, ""):
                continue
            if reply.kind == "error":
                refused = RemoteError if reply.body.get("unavailable") is not True else ServiceUnavailable
                raise refused(str(reply.body.get("error", "refused")))
            return reply
        raise Unreachable(f"no reply from {where} to {kind} within {timeout:g} s")
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
        sock.close(0)


class _Connection:
    """What one call's socket saw of its connection: a connection refused again and again for
    ``REFUSED_FOR`` seconds (nothing listens there) or a handshake that keeps failing ends the call
    at once, instead of after its whole timeout."""

    def __init__(self) -> None:
        self.connected = False
        self.refused = 0
        self.failed_handshakes = 0

    def saw(self, event: dict, where: str, server_key: bytes | None, kind: str, keys: KeyPair | None,
            elapsed: float) -> None:
        if event["event"] == zmq.EVENT_CONNECTED:
            self.connected = True
        elif event["event"] == zmq.EVENT_CONNECT_RETRIED:
            self.refused += 1
            if not self.connected and self.refused >= REFUSED_TRIES and elapsed >= REFUSED_FOR:
                raise Unreachable(f"nothing answers at {where} (connections refused for {elapsed:.1f} s): {kind} "
                                  "was not sent")
        else:  # ZeroMQ connects again by itself: a cut handshake may be a glitch
            self.failed_handshakes += 1
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH or self.failed_handshakes >= HANDSHAKE_TRIES:
                _raise_handshake_failure(event, where, server_key, kind, keys or own_identity(),
                                         self.failed_handshakes)


def _raise_handshake_failure(event: dict, where: str, server_key: bytes, kind: str, me: KeyPair, tries: int) -> None:
    """Say what was seen: the server refused this key, or the connection closed during the handshake
    (ZeroMQ cannot tell a server holding another key from a relay or firewall cutting it)."""
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        raise KeyRefused(f"{where} refused this participant's key ({key_text(me.public)}) for {kind}: "
                        "it was revoked, or is not admitted to this network")
    raise KeyMismatch(f"the connection to {where} closed during the encrypted handshake for key "
                      f"{key_text(server_key)} ({kind}, {tries} tries): the server there holds another key, or "
                      "something in between (a relay whose participant is gone, a firewall) cut it; nothing was sent")


class _ByKey:
    """ZAP credentials for one server: its ``admit`` decides on each client key."""

    def __init__(self, admit: Callable[[bytes], bool]):
        self.admit = admit

    def callback(self, domain: str, z85_key: bytes) -> bool:
        try:
            return bool(self.admit(zmq.utils.z85.decode(z85_key)))
        except Exception:  # a failing check admits nobody, and must not stop the ZAP thread
            log.exception("admission check failed")
            return False


class _Authenticator(ThreadAuthenticator):
    """ZeroMQ's ZAP handler for this process; a connection's User-Id is the client's key as printed."""

    def curve_user_id(self, client_key: bytes) -> str:
        return key_text(client_key)


_authenticator: _Authenticator | None = None
_authenticator_lock = threading.Lock()


def _zap_domain(name: str, admit: Callable[[bytes], bool]) -> str:
    """A ZAP domain of its own for one server, served by the process's authenticator thread."""
    global _authenticator
    with _authenticator_lock:
        if _authenticator is None:
            _authenticator = _Authenticator(zmq.Context.instance(), log=logging.getLogger("meshlearn.zap"))
            _authenticator.start()
        domain = f"{name.split()[0]}-{uuid.uuid4().hex[:12]}"
        _authenticator.configure_curve_callback(domain, credentials_provider=_ByKey(admit))
    return domain


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


def _state_version(sock: zmq.Socket, version: int) -> None:
    """Have ``sock`` state ``version`` (and this release) at each connection's handshake."""
    for prop in handshake.properties(version):
        sock.setsockopt(zmq.METADATA, prop)


def _drain(wake: socket.socket) -> None:
    """Read every byte waiting on the serving loop's wake-up socket."""
    try:
        while wake.recv(4096):
            pass
    except BlockingIOError:
        pass


def _peer_address(frame: zmq.Frame) -> str:
    """The address a received message came from (ZeroMQ's metadata)."""
    return _property(frame, "Peer-Address") or "an unknown address"


def _property(frame: zmq.Frame, name: str) -> str:
    """A connection property ZeroMQ attaches to a received frame ("" if it has none)."""
    try:
        return frame.get(name) or ""
    except (zmq.ZMQError, AttributeError, TypeError):
        return ""
