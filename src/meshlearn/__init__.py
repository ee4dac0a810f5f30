"""meshlearn: peer-to-peer training of PyTorch models, with no central server."""

__version__ = "0.1.0"
