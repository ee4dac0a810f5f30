"""The transports' settings: what every link needs, and TCP's and UDP's own knobs.

Kept apart from the transports (no torch, no ZeroMQ here), so a configuration is validated, and
the command line answers, without loading either.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from meshlearn.settings import MaxMessageMb, MessageLimit

# The largest multiple of 8 bytes that, with the 48-byte header and 28 bytes of IP/UDP headers,
# fits one unfragmented IP packet on lo (MTU 65,536): fewer datagrams, fewer syscalls.
LOOPBACK_CHUNK = 65_456
ETHERNET_CHUNK = 1_424  # + 48 + 28 = 1,500: one standard Ethernet frame, no IP fragmentation


class LinkSettings(MessageLimit):
    """What every transport of a node needs, whatever carries its messages (``max_message_bytes``:
    the size cap in bytes, as the transports enforce it)."""

    handshake_timeout: float = Field(60.0, gt=0, description="seconds for every neighbour to answer HELLO; "
                                                             "after it, an error names the silent ones")
    max_message_mb: MaxMessageMb


class TcpSettings(LinkSettings):
    """The TCP (ZeroMQ) transport's settings; it also carries gossip's pulls and the leader's pushes."""

    wait_timeout: float = Field(60.0, gt=0, description="seconds to wait for neighbours' models each iteration "
                                "(a timeout is counted, not fatal), and for their goodbye when closing")
    linger: float = Field(5.0, ge=0, description="seconds queued messages may still leave after close")


class UdpSettings(LinkSettings):
    """The UDP transport's settings (flat names in experiment files: ``udp_mode``, ``udp_timeout``, ...)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"mode": "udp_mode", "timeout": "udp_timeout", "rate_gbps": "udp_rate_gbps"}

    mode: Literal["sync", "async"] = Field("sync", description="wait for every neighbour's chunks or the timeout "
                                           "(sync), or use whatever arrived (async)")
    timeout: float = Field(0.4, gt=0, description="sync mode: seconds to wait for neighbours' chunks")
    chunk_bytes: int = Field(0, ge=0, description="payload bytes per datagram (0 = fit the path: 65456 on "
                                                  "loopback, 1424 otherwise)")
    late_chunks: Literal["use", "drop"] = Field(
        "use", description="sync mode: chunks that miss their deadline fill the sender's missing chunks at the "
        "next iteration (use) or are dropped (drop, the UDP study's behaviour); always dropped with a sharing "
        "scheme, whose earlier message holds other positions")
    rate_gbps: float = Field(16.0, gt=0, description="sender pacing, in Gbit/s (as the batched engine's "
                             "bandwidth_gbps)")
    rcvbuf_mb: float = Field(64.0, gt=0, description="receive buffer asked of the kernel, in MiB")

    @field_validator("chunk_bytes")
    @classmethod
    def _valid_chunk(cls, value: int) -> int:
        if value and (value % 8 or value > LOOPBACK_CHUNK):
            raise ValueError(f"must be 0 (auto) or a multiple of 8 up to {LOOPBACK_CHUNK}")
        return value


def default_chunk_bytes(host: str) -> int:
    """Payload bytes per datagram that fit the path without IP fragmentation."""
    return LOOPBACK_CHUNK if host.startswith("127.") or host == "localhost" else ETHERNET_CHUNK
