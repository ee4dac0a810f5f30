"""How many connections a dashboard holds: a page is public to every process on its machine (and,
with its token, to others), so idle connections must not eat the descriptors the services that
share its process (the bootstrap's RPC and relay) need.

uvicorn holds a connection that never sends a request for as long as the client keeps it open.
The protocol here closes one that has sent no request within ``FIRST_REQUEST_TIMEOUT``, and keeps
at most ``MAX_CONNECTIONS``: a newcomer beyond that evicts the oldest idle connection (no request
in progress; open pages' event streams are not idle), and is itself turned away only when none is.
"""

from __future__ import annotations

import time

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
