"""Transports: how messages travel between nodes (push: TCP over ZeroMQ, UDP; pull: gossip)."""

from meshlearn.transport.base import Endpoint, Transport, TransportStats, Unconnected
from meshlearn.transport.tcp import TcpTransport

__all__ = ["Endpoint", "TcpTransport", "Transport", "TransportStats", "Unconnected"]
