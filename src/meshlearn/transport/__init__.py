"""Transports: how messages travel between nodes (TCP over ZeroMQ; UDP comes next)."""

from meshlearn.transport.base import Transport, TransportStats
from meshlearn.transport.tcp import TcpTransport

__all__ = ["TcpTransport", "Transport", "TransportStats"]
