"""ZeroMQ set-up shared by the TCP transport, the served endpoints and the network's RPC."""

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


def make_curve_server(sock: zmq.Socket, public: bytes, secret: bytes, zap_domain: str = "") -> None:
    """Make ``sock`` (before bind) a CurveZMQ server holding this key pair: every connection is
    encrypted and authenticated, and the ZAP handler of ``zap_domain`` (if any) admits clients by key."""
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    if zap_domain:
        sock.zap_domain = zap_domain.encode()


def make_curve_client(sock: zmq.Socket, public: bytes, secret: bytes, server_key: bytes) -> None:
    """Make ``sock`` (before connect) a CurveZMQ client that talks only to the holder of ``server_key``."""
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_key

