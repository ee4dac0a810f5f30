"""The wire format: versioned binary messages of raw tensor frames, strictly decoded."""

from meshlearn.wire.codec import DEFAULT_MAX_BYTES, DTYPES, Chunks, Kind, Message, decode, encode, meta_number

__all__ = ["Chunks", "DEFAULT_MAX_BYTES", "DTYPES", "Kind", "Message", "decode", "encode", "meta_number"]
