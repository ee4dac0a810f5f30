"""The wire format: versioned binary messages of raw tensor frames, strictly decoded.

Names are imported on first use: ``wire.auth`` (used by every signed control message) loads
without torch."""

from meshlearn.lazy import lazy_exports

_WHERE = {name: "codec" for name in ("Chunks", "DEFAULT_MAX_BYTES", "DTYPES", "Kind", "Message", "decode", "encode")}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
