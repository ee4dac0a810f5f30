"""How many connections a dashboard holds: a page is public to every process on its machine (and,
with its token, to others), so idle connections must not eat the descriptors the services that
share its process (the bootstrap's RPC and relay) need.

uvicorn holds a connection that never sends a request for as long as the client keeps it open.
The protocol here closes one that has sent no request within ``FIRST_REQUEST_TIMEOUT``, and keeps
at most ``MAX_CONNECTIONS``: a newcomer beyond that evicts the oldest idle connection (no request
in progress; open pages' event streams are not idle), and is itself turned away only when none is.

Out of descriptors or memory, the listener rests and says so in one line (``accepting``), as the
relay's ports do: see ``PausingListener``.
"""

from __future__ import annotations

import errno
import socket
import time
from asyncio.constants import ACCEPT_RETRY_DELAY

from meshlearn.accepting import SHORTAGE, say_paused

MAX_CONNECTIONS = 128
FIRST_REQUEST_TIMEOUT = 10.0  # seconds a new connection has to send its first request


def bounded_http_protocol(max_connections: int = MAX_CONNECTIONS, first_request_timeout: float = FIRST_REQUEST_TIMEOUT):
    """uvicorn's h11 HTTP protocol with the bounds above (a class for ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        """An h11 connection that counts against the server's cap and must speak in time."""

        opened_at = 0.0

        def connection_made(self, transport) -> None:
            crowded = len(self.connections) >= max_connections and not _evict_oldest_idle(self.connections)
            super().connection_made(transport)
            if crowded:
                transport.close()
                return
            self.opened_at = time.monotonic()
            self.loop.call_later(first_request_timeout, self._close_if_silent)

        def _close_if_silent(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        @property
        def idle(self) -> bool:
            """No request in progress (none yet, or the last one answered)."""
            return self.cycle is None or self.cycle.response_complete

    return BoundedH11Protocol


def _evict_oldest_idle(connections) -> bool:
    """Close the oldest idle connection; whether there was one."""
    idle = [c for c in connections if getattr(c, "idle", False) and not c.transport.is_closing()]
    if not idle:
        return False
    min(idle, key=lambda c: c.opened_at).transport.close()
    return True


class PausingListener(socket.socket):
    """The dashboard's listening socket, for asyncio's selector loop. When accept() fails for want
    of descriptors or memory, that loop stops watching the socket for ``ACCEPT_RETRY_DELAY`` (1 s)
    but still calls accept() again, up to the server's backlog (uvicorn: 2,048) times in that
    wake-up, reporting each failure and arming a resume for each. So after a shortage this socket's
    next accept() says there is nothing to accept, which ends that wake-up: one failure per pause."""

    _short = False  # the last accept() failed for want of descriptors or memory

    def accept(self):
        if self._short:
            self._short = False
            raise BlockingIOError(errno.EAGAIN, "resting: the last accept() ran out of descriptors or memory")
        try:
            return super().accept()
        except OSError as exc:
            self._short = exc.errno in SHORTAGE
            raise


def say_accept_pauses(name: str):
    """An asyncio exception handler (``loop.set_exception_handler``): the loop's report of a
    listener out of descriptors or memory becomes one line (``say_paused``), not a traceback;
    anything else goes to the loop's default handler."""

    def handle(loop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in SHORTAGE and "accept" in context.get("message", ""):
            say_paused(name, exc, ACCEPT_RETRY_DELAY)
        else:
            loop.default_exception_handler(context)

    return handle
