"""Asking a port before trusting it: the bootstrap's key as its relay port announces it, and
whether anything takes a connection at an address at all."""

from __future__ import annotations

import socket

from meshlearn.errors import NetworkError, Unreachable
from meshlearn.network.channel.relaywire import (
    KEY_REPLY,
    KEY_REQUEST,
    host_port,
    read_line,
)


def fetch_key_line(relay: str, timeout: float = 5.0) -> str:
    """The bootstrap's public key as its relay port announces it (unauthenticated: trust on first use).
    Unreachable where nothing takes the connection; NetworkError where something does but announces no key."""
    sock = _connect(relay, timeout)
    try:
        with sock:
            sock.sendall(KEY_REQUEST + b"\n")
            line = read_line(sock, timeout)
    except OSError as exc:
        raise NetworkError(f"cannot ask {relay} for the bootstrap's key: {exc}") from None
    if not line.startswith(KEY_REPLY):
        raise NetworkError(f"{relay} did not announce a bootstrap key")
    return line[len(KEY_REPLY):].decode(errors="replace").strip()


def refusal(address: str, timeout: float = 5.0) -> str | None:
    """Why nothing at ``HOST:PORT`` takes a TCP connection ("connection refused", "timed out"), or
    None where something does (the connection closed at once, nothing sent): tells a service that
    is not running from one that answers in a way the caller did not expect."""
    try:
        socket.create_connection(host_port(address), timeout=timeout).close()
    except OSError as exc:
        return _reason(exc)
    return None


def _connect(address: str, timeout: float) -> socket.socket:
    """A TCP connection to ``HOST:PORT``; Unreachable, saying why, where none is made."""
    try:
        return socket.create_connection(host_port(address), timeout=timeout)
    except OSError as exc:
        raise Unreachable(f"cannot connect to {address}: {_reason(exc)}") from None


def _reason(exc: OSError) -> str:
    """What a failed connection met, in words: "connection refused", "timed out"."""
    return (exc.strerror or str(exc) or type(exc).__name__).lower()
