"""Transports: how messages travel between nodes (push: TCP over ZeroMQ, UDP; pull: gossip; the
leader's hub), and their settings (``transport.settings``, which loads neither torch nor ZeroMQ).

Names are imported on first use, so reading settings does not load the transports."""

from meshlearn.lazy import lazy_exports

_WHERE = {"Endpoint": "base", "Transport": "base", "TransportStats": "base", "Unconnected": "base",
          "TcpTransport": "tcp", "TcpSettings": "settings", "UdpSettings": "settings", "LinkSettings": "settings"}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
