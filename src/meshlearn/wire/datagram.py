"""UDP datagrams: a fixed binary header and one chunk of a message's raw bytes.

Layout (little-endian, 48 bytes)::

    magic "MSHU" | version u8 | kind u8 | flags u8 | reserved u8 | sender u32 | iteration u64
    | chunk index u32 | chunk count u32 | chunk bytes u32 | degree u32 | total bytes u64
    | checksum u32 (CRC-32C of the header up to the checksum, then the payload)

CRC-32C (Castagnoli, as in iSCSI and ext4) rather than zlib's CRC-32: the ``crc32c`` package
computes it with the CPU's CRC instruction at over 10 GB/s, where zlib's CRC-32 runs at about
1 GB/s and capped UDP goodput (see benchmarks/RESULTS.md).

A message of ``total`` bytes is cut into ``count`` chunks of ``chunk bytes`` (the last may be
shorter); chunk ``i`` carries bytes ``[i * chunk_bytes, ...)``. Nothing is pickled.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from crc32c import crc32c

from meshlearn.errors import WireError
from meshlearn.wire.codec import Kind

MAGIC = b"MSHU"
VERSION = 2  # 2: CRC-32C checksum (1 used zlib's CRC-32)
HEADER = struct.Struct("<4sBBBBIQIIIIQI")
HEADER_SIZE = HEADER.size
CHECKSUM = struct.Struct("<I")
MAX_DATAGRAM = 65507  # the largest UDP payload over IPv4
FLAG_HEARD = 1  # on HELLO: "I have heard you", which completes the handshake for the receiver
FLAG_REPLY = 2  # on HELLO: an answer to a HELLO; never answered itself (no ping-pong)


class ChunkHeader(NamedTuple):
    """The fixed header of one datagram (a NamedTuple: built once per datagram received, so cheap)."""

    kind: Kind
    sender: int
    iteration: int
    index: int
    count: int
    chunk_bytes: int
    degree: int
    total: int
    flags: int = 0

    def payload_size(self) -> int:
        """Bytes of payload chunk ``index`` must carry."""
        return max(0, min(self.chunk_bytes, self.total - self.index * self.chunk_bytes))


def chunk_count(total: int, chunk_bytes: int) -> int:
    """How many chunks a message of ``total`` bytes needs (1 for an empty message)."""
    return max(1, -(-total // chunk_bytes))


def pack_header(header: ChunkHeader, payload: list[memoryview] | tuple = ()) -> bytes:
    """The header bytes for one datagram, with its checksum over the header and the payload pieces."""
    return pack_fields(header.kind, header.flags, header.sender, header.iteration, header.index, header.count,
                       header.chunk_bytes, header.degree, header.total, payload)


def pack_fields(kind: int, flags: int, sender: int, iteration: int, index: int, count: int, chunk_bytes: int,
                degree: int, total: int, payload: list[memoryview] | tuple = ()) -> bytes:
    """``pack_header`` from plain fields: the per-datagram hot path, without building a ChunkHeader."""
    head = HEADER.pack(MAGIC, VERSION, int(kind), flags, 0, sender, iteration, index, count, chunk_bytes, degree,
                       total, 0)[:-4]
    crc = crc32c(head)
    for piece in payload:
        crc = crc32c(piece, crc)
    return head + CHECKSUM.pack(crc)


def parse_datagram(data: memoryview, max_total: int) -> tuple[ChunkHeader, memoryview]:
    """Validate one received datagram; return its header and a view of its payload.

    Raises WireError on a short datagram, wrong magic or version, unknown kind, inconsistent
    chunk numbers, a payload of the wrong size, a message over ``max_total`` bytes, or a bad checksum.
    """
    if len(data) < HEADER_SIZE:
        raise WireError(f"datagram of {len(data)} bytes is shorter than the {HEADER_SIZE}-byte header")
    header, checksum = parse_header(data[:HEADER_SIZE], max_total)
    payload = data[HEADER_SIZE:]
    check_payload(data[:HEADER_SIZE], header, checksum, payload)
    return header, payload


def parse_header(head: memoryview, max_total: int) -> tuple[ChunkHeader, int]:
    """Validate a datagram's ``HEADER_SIZE`` header bytes; return the header and its checksum.

    The payload is not checked yet (``check_payload`` does): a receiver may read the header and
    the payload into different buffers.
    """
    if len(head) < HEADER_SIZE:
        raise WireError(f"datagram header of {len(head)} bytes is shorter than {HEADER_SIZE} bytes")
    (magic, version, kind, flags, reserved, sender, iteration, index, count, chunk_bytes, degree, total,
     checksum) = HEADER.unpack_from(head, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not a meshlearn datagram")
    if version != VERSION:
        raise WireError(f"unsupported datagram version {version} (this build speaks version {VERSION})")
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError(f"unknown message kind {kind}") from None
    if reserved != 0 or flags & ~(FLAG_HEARD | FLAG_REPLY):
        raise WireError("unknown header flags")
    if total > max_total:
        raise WireError(f"message of {total} bytes exceeds the size cap of {max_total} bytes")
    if chunk_bytes == 0 or chunk_bytes > MAX_DATAGRAM:
        raise WireError(f"chunk size {chunk_bytes} is outside 1..{MAX_DATAGRAM}")
    if count != chunk_count(total, chunk_bytes) or index >= count:
        raise WireError(f"chunk {index} of {count} does not fit a message of {total} bytes in {chunk_bytes}-byte chunks")
    return ChunkHeader(kind, sender, iteration, index, count, chunk_bytes, degree, total, flags), checksum


def check_payload(head: memoryview, header: ChunkHeader, checksum: int, payload: memoryview) -> None:
    """Raise WireError unless ``payload`` has the size ``header`` announces and matches ``checksum``."""
    if len(payload) != header.payload_size():
        raise WireError(f"chunk {header.index} carries {len(payload)} bytes, expected {header.payload_size()}")
    if checksum != crc32c(payload, crc32c(head[:HEADER_SIZE - 4])):
        raise WireError("checksum mismatch: the datagram was corrupted")
