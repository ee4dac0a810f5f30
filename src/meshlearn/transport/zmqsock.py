"""ZeroMQ set-up shared by the TCP transport and the gossip pull endpoint."""

from __future__ import annotations

import errno

import zmq

from meshlearn.errors import PortInUseError, TransportError


def bind_router(ctx: zmq.Context, node_id: int, host: str, port: int, max_frame_bytes: int,
                options: dict[int, int] | None = None) -> zmq.Socket:
    """A ROUTER socket bound to ``host:port`` (port 0: any free port). libzmq refuses, and
    disconnects, any single frame over ``max_frame_bytes`` before buffering it. Raises
    PortInUseError for a taken port, TransportError otherwise (the socket is closed then)."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    for option, value in (options or {}).items():
        router.setsockopt(option, value)
    where = f"{host}:{'*' if port == 0 else port}"
    try:
        router.bind(f"tcp://{where}")
    except zmq.ZMQError as exc:
        router.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is in use: choose another port or stop the process "
                                 "using it") from None
        raise TransportError(f"node {node_id}: cannot listen on {where}: {exc}") from None
    return router
