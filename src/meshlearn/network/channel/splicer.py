"""The machinery the relay and its agents run on: one thread per service, whatever strangers do.

A ``Loop`` serves every socket of a service from one thread through ``selectors``: readiness
callbacks, timers, and calls handed over from other threads. So a connection costs a descriptor,
never a thread. An ``Acceptor`` takes connections off a listening socket and survives running out
of descriptors (it pauses, then accepts again). A ``Splicer`` joins two connected sockets and
copies bytes both ways without blocking: on Linux the bytes never enter Python (``os.splice``
through a kernel pipe, lent to a direction only while bytes sit in it), elsewhere through one
buffer shared by the loop. ``dial`` connects without blocking the loop.

Everything here runs in the loop's thread, except ``Loop.start``, ``Loop.stop`` and
``Loop.call_soon``.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from meshlearn.accepting import ACCEPT_PAUSE, say_paused
from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)
_accept_warnings = SparseLog(log)  # shared by every Acceptor: a bug with new connections is not a line per port

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
ZERO_COPY = hasattr(os, "splice")  # Linux: socket -> pipe -> socket inside the kernel
SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
CHUNK = 1 << 20  # bytes one step of a direction moves (a pipe's size, where the system allows it)
ROUNDS = 8  # steps one direction takes per wake-up before the loop serves the others
SPARE_PIPES = 8  # empty pipes kept for the next chunk instead of closed and made again
PIPE_RETRY = 0.05  # seconds a direction waits when no pipe can be had (descriptors short, or all lent)
ACCEPT_BATCH = 32  # connections taken per wake-up of a listener: one busy port cannot starve the others
DIAL_TIME = 10.0  # seconds dial() waits for a connection
STEP_RETRY = 0.01  # seconds the loop rests after a wake-up failed as a whole (a bug: logged)
# accept() errors about that one connection (Linux passes a new connection's network errors on): take the next
ONE_CONNECTION = {getattr(errno, name) for name in ("ECONNABORTED", "EPROTO", "EPERM", "ENETDOWN", "ENOPROTOOPT",
                                                    "EHOSTDOWN", "ENONET", "EHOSTUNREACH", "EOPNOTSUPP",
                                                    "ENETUNREACH") if hasattr(errno, name)}


@dataclass(order=True)
class Timer:
    """A call a Loop makes at ``when`` (time.monotonic()), unless cancelled first."""

    when: float
    sequence: int
    call: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        """Take the call back (it stays in the heap until due, then is skipped)."""
        self.cancelled = True


class Loop:
    """One thread serving many sockets: callbacks on readiness (``watch``), timers (``call_later``,
    ``every``) and calls from other threads (``call_soon``). A failing callback is logged (sparsely)
    and never ends the loop; only ``stop()`` does, after which ``on_stop`` runs in the loop's
    thread (or in the caller's, if the loop never started) to close what its owner holds."""

    def __init__(self, name: str, on_stop: Callable[[], None] = lambda: None):
        self.name = name
        self._on_stop = on_stop
        self._selector: selectors.BaseSelector | None = None
        self._watched: dict[socket.socket, tuple[int, Callable[[int], None]]] = {}  # events, callback
        self._timers: list[Timer] = []
        self._sequence = itertools.count()
        self._calls: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()
        self._waker: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._finished = False
        self._warn = SparseLog(log)

    def start(self) -> None:
        """Start the loop's thread (calls handed over before now run first)."""
        self._selector = selectors.DefaultSelector()
        self._waker = socket.socketpair()
        for end in self._waker:
            end.setblocking(False)
        self.watch(self._waker[0], READ, self._drain_waker)
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop and wait for it (unless called from the loop itself: it ends after this callback)."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        if thread is None:
            self._finish()
        elif thread is not threading.current_thread():
            self._wake()
            thread.join()

    def call_soon(self, call: Callable[[], None]) -> bool:
        """Have the loop make ``call`` (from any thread); False if the loop is over (nothing will run it)."""
        with self._lock:
            if self._finished:
                return False
            self._calls.append(call)
        self._wake()
        return True

    def call_later(self, delay: float, call: Callable[[], None]) -> Timer:
        """Make ``call`` in ``delay`` seconds (from the loop's thread only)."""
        timer = Timer(time.monotonic() + delay, next(self._sequence), call)
        heapq.heappush(self._timers, timer)
        return timer

    def every(self, interval: float, call: Callable[[], None]) -> None:
        """Make ``call`` every ``interval`` seconds, for as long as the loop runs."""
        def tick() -> None:
            self.call_later(interval, tick)
            call()
        self.call_later(interval, tick)

    def watch(self, fileobj: socket.socket, events: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(events that happened)`` while ``fileobj`` is ready for ``events``
        (READ, WRITE, both; 0 stops watching it)."""
        if self._selector is None or self._finished:
            return
        if not events:
            self.unwatch(fileobj)
            return
        watched = self._watched.get(fileobj)
        if watched is None:
            self._selector.register(fileobj, events)
        elif watched[0] != events:
            self._selector.modify(fileobj, events)
        self._watched[fileobj] = (events, callback)

    def unwatch(self, fileobj: socket.socket) -> None:
        """Stop watching ``fileobj`` (nothing if it is not watched); call it before closing one."""
        if self._watched.pop(fileobj, None) is not None and self._selector is not None:
            self._selector.unregister(fileobj)

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._step()
                except Exception as exc:  # a bug here must not end every connection's service either
                    self._warn.warning("step", "%s: serving failed: %r", self.name, exc)
                    time.sleep(STEP_RETRY)  # and must not spin a core if it persists
        finally:
            self._finish()

    def _step(self) -> None:
        for key, mask in self._selector.select(self._timeout()):
            events, callback = self._watched.get(key.fileobj, (0, None))  # an earlier callback may have dropped it
            if mask & events:
                self._safely(callback, mask & events, fileobj=key.fileobj)
        now = time.monotonic()
        while self._timers and self._timers[0].when <= now:
            timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                self._safely(timer.call)
        with self._lock:
            calls, self._calls = self._calls, deque()
        for call in calls:
            self._safely(call)

    def _timeout(self) -> float | None:
        while self._timers and self._timers[0].cancelled:
            heapq.heappop(self._timers)
        if self._calls:
            return 0
        if not self._timers:
            return None
        return max(0.0, self._timers[0].when - time.monotonic())

    def _safely(self, call: Callable, *args, fileobj: socket.socket | None = None) -> None:
        try:
            call(*args)
        except Exception as exc:  # a bug in one callback must not end every connection's service
            self._warn.warning(type(exc).__name__, "%s: a callback failed: %r", self.name, exc)
            if fileobj is not None:
                self.unwatch(fileobj)  # else a socket left ready would call it again at once, forever

    def _wake(self) -> None:
        waker = self._waker
        if waker is None:  # not started: the calls wait for start()
            return
        try:
            waker[1].send(b"\0")
        except OSError:  # full (a wake-up is pending anyway), or closed (the loop is over)
            pass

    def _drain_waker(self, mask: int) -> None:
        try:
            while self._waker[0].recv(4096):
                pass
        except BlockingIOError:
            pass

    def _finish(self) -> None:
        """Make the calls handed over before the end, then ``on_stop``; close the selector."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            calls, self._calls = self._calls, deque()
        for call in calls:
            self._safely(call)
        self._safely(self._on_stop)
        if self._selector is not None:
            self._selector.close()
        for end in self._waker or ():
            end.close()
        self._selector = None
        self._watched.clear()


class Acceptor:
    """Takes connections off a listening socket in a Loop and hands each, non-blocking, to
    ``on_connection(sock, source IP)``. When accept() fails for want of descriptors or memory
    (EMFILE, ENFILE, ENOBUFS, ENOMEM) or anything else not about one connection, the listener
    rests for ACCEPT_PAUSE and then accepts again, the failure logged sparsely and counted by
    ``on_pause``: only close() ends it."""

    def __init__(self, loop: Loop, listener: socket.socket, on_connection: Callable[[socket.socket, str], None],
                 name: str, on_pause: Callable[[], None] = lambda: None):
        self.loop = loop
        self.listener = listener
        self.on_connection = on_connection
        self.name = name
        self.on_pause = on_pause
        self.closed = False
        self._resume: Timer | None = None

    def start(self) -> None:
        """Accept from now on (again, after a pause)."""
        if not self.closed:
            self.listener.setblocking(False)
            self.loop.watch(self.listener, READ, self._ready)

    def close(self) -> None:
        """Stop accepting and close the listening socket."""
        self.closed = True
        if self._resume is not None:
            self._resume.cancel()
        self.loop.unwatch(self.listener)
        close_socket(self.listener)

    def _ready(self, mask: int) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in ONE_CONNECTION:  # reset before we took it, say
                    continue
                self._pause(exc)
                return
            sock.setblocking(False)
            try:
                self.on_connection(sock, peer[0])
            except Exception as exc:  # a bug with one connection must not close the port to everyone
                _accept_warnings.warning("handler", "%s: serving a new connection failed: %r", self.name, exc)

    def _pause(self, exc: OSError) -> None:
        say_paused(self.name, exc, ACCEPT_PAUSE)
        self.on_pause()
        self.loop.unwatch(self.listener)
        self._resume = self.loop.call_later(ACCEPT_PAUSE, self.start)


class PipePool:
    """Kernel pipes for ``os.splice``, lent to a direction only while bytes sit in them (an idle
    splice holds none); at most ``limit`` open at once, SPARE_PIPES empty ones kept for reuse."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open = 0
        self._spare: list[tuple[int, int]] = []

    def take(self) -> tuple[int, int] | None:
        """An empty pipe (read end, write end), or None: all lent, or no descriptor for a new one."""
        if self._spare:
            return self._spare.pop()
        if self.open >= self.limit:
            return None
        try:
            pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.fcntl(pipe[1], fcntl.F_SETPIPE_SZ, CHUNK)
        except OSError:
            pass  # above /proc/sys/fs/pipe-max-size: the default 64 KiB pipe
        self.open += 1
        return pipe

    def give(self, pipe: tuple[int, int], empty: bool = True) -> None:
        """Take back a pipe (closed if bytes are left in it, or enough are spare)."""
        if empty and len(self._spare) < SPARE_PIPES:
            self._spare.append(pipe)
            return
        self.open -= 1
        for end in pipe:
            os.close(end)

    def close(self) -> None:
        """Close the spare pipes (those lent are closed by their splices)."""
        while self._spare:
            self.give(self._spare.pop(), empty=False)


class Splicer:
    """Joins pairs of connected sockets in one Loop (``join``), with at most ``max_pipes`` kernel
    pipes lent at once; without ``os.splice``, bytes go through one buffer of this splicer's."""

    def __init__(self, loop: Loop, max_pipes: int):
        self.loop = loop
        self.pipes = PipePool(max_pipes) if ZERO_COPY else None
        self.buffer = None if ZERO_COPY else bytearray(CHUNK)

    def join(self, a: socket.socket, b: socket.socket, on_done: Callable[[Splice], None],
             first: bytes = b"") -> Splice:
        """A splice of ``a`` and ``b`` (non-blocking sockets, now owned by it) that writes ``first``
        to ``b`` before anything ``a`` sends; call its ``start()``."""
        return Splice(self, a, b, on_done, first)

    def close(self) -> None:
        """Close what the splicer keeps (its splices are closed by their owners)."""
        if self.pipes is not None:
            self.pipes.close()


class Splice:
    """Two sockets joined both ways. When either side ends (EOF, once what it sent is written
    out: no half-closed splice lingers, as nginx's stream proxy by default) or fails, or on
    ``close()``, the splice closes both sockets and calls ``on_done(self)``. ``last_active``:
    when bytes last moved either way; ``moved``: how many."""

    def __init__(self, splicer: Splicer, a: socket.socket, b: socket.socket, on_done: Callable[[Splice], None],
                 first: bytes = b""):
        self.splicer = splicer
        self.a, self.b = a, b
        self.on_done = on_done
        self.last_active = time.monotonic()
        self.closed = False
        self.moved = 0  # bytes read from either side so far (what a relayed link costs the relay)
        self._forward = _Direction(self, a, b, first)
        self._backward = _Direction(self, b, a)
        self._callbacks = {a: partial(self._ready, a), b: partial(self._ready, b)}

    def start(self) -> None:
        """Write ``first`` and move whatever is there already; the loop does the rest."""
        self._advance(self._forward, self._backward)

    def touch(self) -> None:
        """Bytes moved just now."""
        self.last_active = time.monotonic()

    def close(self) -> None:
        """Close both sockets (any bytes still in a pipe are lost) and call ``on_done``, once."""
        if self.closed:
            return
        self.closed = True
        for sock in (self.a, self.b):
            self.splicer.loop.unwatch(sock)
            sock.close()
        for direction in (self._forward, self._backward):
            if direction.pipe is not None:
                self.splicer.pipes.give(direction.pipe, empty=not direction.in_pipe)
                direction.pipe = None
        self.on_done(self)

    def resume(self, direction: _Direction) -> None:
        """Move ``direction`` again (a pipe retry came due)."""
        if not self.closed:
            self._advance(direction)

    def _ready(self, sock: socket.socket, mask: int) -> None:
        source_of, sink_of = (self._forward, self._backward) if sock is self.a else (self._backward, self._forward)
        self._advance(*([source_of] if mask & READ else []), *([sink_of] if mask & WRITE else []))

    def _advance(self, *directions: _Direction) -> None:
        try:
            for direction in directions:
                if not direction.done:
                    direction.move()
        except OSError:  # reset, broken pipe, ...: this splice is over
            self.close()
            return
        if self._forward.done or self._backward.done:
            self.close()
        elif not self.closed:
            self._watch()

    def _watch(self) -> None:
        forward, backward = self._forward, self._backward
        loop = self.splicer.loop
        loop.watch(self.a, (forward.wants & READ) | (backward.wants & WRITE), self._callbacks[self.a])
        loop.watch(self.b, (backward.wants & READ) | (forward.wants & WRITE), self._callbacks[self.b])


class _Direction:
    """Bytes from ``source`` to ``sink``: ``first``, then what the source sends until it ends
    (``done``: all of it written). ``wants``: what it waits for (READ: the source to have bytes,
    WRITE: the sink to take them, 0: a pipe, or nothing more)."""

    def __init__(self, splice: Splice, source: socket.socket, sink: socket.socket, first: bytes = b""):
        self.splice = splice
        self.source, self.sink = source, sink
        self.source_fd, self.sink_fd = source.fileno(), sink.fileno()
        self.unsent = memoryview(first)  # bytes read but not yet written (first bytes, the buffer path)
        self.pipe: tuple[int, int] | None = None
        self.in_pipe = 0
        self.ended = False  # the source sent its last byte
        self.done = False  # ... and the sink has it all
        self.wants = READ

    def move(self) -> None:
        """Move what can be moved now, at most ROUNDS chunks (OSError: the splice failed)."""
        for _ in range(ROUNDS):
            if not self._flush():
                return
            if self.ended:
                self.done = True
                self.wants = 0
                return
            if not self._fill():
                return
        self.wants = WRITE if self.unsent or self.in_pipe else READ

    def _flush(self) -> bool:
        """Write out what was read; False if the sink cannot take it all now."""
        try:
            while self.unsent:
                self.unsent = self.unsent[self.sink.send(self.unsent):]
            while self.in_pipe:
                self.in_pipe -= os.splice(self.pipe[0], self.sink_fd, self.in_pipe, flags=SPLICE_FLAGS)
        except BlockingIOError:
            self.wants = WRITE
            return False
        return True

    def _fill(self) -> bool:
        """Read what the source has (into the pipe, empty now); False if it has nothing now (the
        pipe goes back), or no pipe can be had."""
        pipes = self.splice.splicer.pipes
        if pipes is None:
            return self._fill_through_buffer()
        if self.pipe is None:
            self.pipe = pipes.take()
            if self.pipe is None:
                self.wants = 0
                self.splice.splicer.loop.call_later(PIPE_RETRY, partial(self.splice.resume, self))
                return False
        try:
            count = os.splice(self.source_fd, self.pipe[1], CHUNK, flags=SPLICE_FLAGS)
        except BlockingIOError:
            count = None
        if count:
            self.in_pipe = count
            self.splice.moved += count
            self.splice.touch()
            return True
        pipes.give(self.pipe)
        self.pipe = None
        if count is None:
            self.wants = READ
            return False
        self.ended = True
        return True

    def _fill_through_buffer(self) -> bool:
        """Read into the splicer's shared buffer and write at once; what the sink did not take is
        copied aside (the buffer serves every splice)."""
        view = memoryview(self.splice.splicer.buffer)
        try:
            count = self.source.recv_into(view)
        except BlockingIOError:
            self.wants = READ
            return False
        if not count:
            self.ended = True
            return True
        try:
            sent = self.sink.send(view[:count])
        except BlockingIOError:
            sent = 0
        self.unsent = memoryview(bytes(view[sent:count]))
        self.splice.moved += count
        self.splice.touch()
        return True


def dial(loop: Loop, address: tuple[str, int], done: Callable[[socket.socket, OSError | None], None],
         timeout: float = DIAL_TIME) -> socket.socket | None:
    """Connect to ``address`` without blocking the loop: ``done(sock, None)`` once connected (a
    non-blocking socket), ``done(sock, error)`` (the socket closed) if that failed or took longer
    than ``timeout``. Returns the socket (to close it early), None if none could be made (then
    ``done(None, error)`` comes from the loop)."""
    try:
        family, kind, proto, _, target = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        loop.call_soon(partial(done, None, exc))
        return None
    sock.setblocking(False)
    code = sock.connect_ex(target)
    if code not in (0, errno.EINPROGRESS):
        sock.close()
        loop.call_soon(partial(done, sock, OSError(code, os.strerror(code))))
        return sock

    def finish(error: OSError | None) -> None:
        timer.cancel()
        loop.unwatch(sock)
        code = 0 if error else sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            error = OSError(code, os.strerror(code))
        if error is not None:
            sock.close()
        done(sock, error)
    timer = loop.call_later(timeout, partial(finish, TimeoutError(f"no connection within {timeout:g} s")))
    loop.watch(sock, WRITE, lambda mask: finish(None))
    return sock


def close_socket(sock: socket.socket) -> None:
    """Shut down (so the peer learns at once) and close, whatever state it is in."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
