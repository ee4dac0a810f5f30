"""Checks on listening ports, made before any node starts."""

from __future__ import annotations

import errno
import socket

from meshlearn.errors import PortInUseError, UserInputError


def ensure_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if ``port`` on ``host`` cannot be listened on right now."""
    if not 1 <= port <= 65535:
        raise UserInputError(f"port {port} is outside 1..65535: choose a port in that range")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"port {port} on {host} is in use: choose another port or stop the process using it"
                ) from None
            raise UserInputError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
