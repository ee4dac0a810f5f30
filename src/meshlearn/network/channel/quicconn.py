"""What a QUIC path (quicpath.py) needs of aioquic beyond its public interface, kept in one place:
the ephemeral certificates each side pins the other's by, and ``PathConnection``, aioquic's
connection with three changes.

- The server asks the client for its certificate. aioquic can (its TLS context answers a
  certificate request as a client and checks the client's CertificateVerify signature as a
  server) but offers no setting for it: the request is switched on through the TLS context's
  ``_request_client_certificate``. Neither side checks a chain (``verify_mode=CERT_NONE``): each
  checks the SHA-256 fingerprint of the certificate the other presented, once the handshake is
  done (``peer_certificate``); the handshake has already verified that the peer holds its key.
- Stream receive windows follow what the local side consumed. aioquic raises a stream's window as
  data *arrives* (it doubles whenever half is used), so a slow reader would let the sender fill
  this process's memory. Here a stream's window is what was handed on to the local TCP connection
  plus STREAM_WINDOW (``allowance``).
- ``unsent`` tells how much of a stream's data aioquic holds not yet sent, for the sender to stop
  reading from its TCP connection while it is over a bound (aioquic has no back-pressure of its
  own), and ``held`` how much it holds in all.

These reach into aioquic's internals (``tls``, ``_streams``, stream fields): pyproject.toml bounds
aioquic to the release lines tests/test_quicpath.py has passed with (1.2.0 and 1.7.2 tried).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import MAX_STREAM_DATA_FRAME_CAPACITY, QuicConnection
from aioquic.quic.packet import QuicFrameType
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

ALPN = "meshlearn-path/1"  # the application protocol both sides name: another one is refused in the handshake
STREAM_WINDOW = 4 << 20  # bytes a stream's sender may have beyond what the receiving side handed on
WINDOW_STEP = STREAM_WINDOW // 4  # a stream's window is raised by at least this much at a time (fewer frames)
CERTIFICATE_DAYS = 2  # validity of an ephemeral certificate (nobody checks the dates: it is pinned)
CONGESTION_CONTROL = "cubic"
DATAGRAM_SIZE = 1200  # QUIC payload bytes per UDP datagram: the size every path must carry (RFC 9000 14.1)


@dataclass(frozen=True)
class PathCertificate:
    """An ephemeral self-signed Ed25519 certificate and its key; ``fingerprint`` (SHA-256 of its
    DER form) is what the other side pins, sent over the authenticated control channel."""

    certificate: x509.Certificate
    private_key: ed25519.Ed25519PrivateKey

    @classmethod
    def generate(cls) -> PathCertificate:
        """A new certificate for one path."""
        key = ed25519.Ed25519PrivateKey.generate()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshlearn quic path")])
        now = datetime.datetime.now(datetime.timezone.utc)
        certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                       .public_key(key.public_key()).serial_number(x509.random_serial_number())
                       .not_valid_before(now - datetime.timedelta(days=1))
                       .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
                       .sign(key, None))
        return cls(certificate, key)

    @property
    def fingerprint(self) -> bytes:
        return certificate_fingerprint(self.certificate)


def certificate_fingerprint(certificate: x509.Certificate) -> bytes:
    """SHA-256 of ``certificate``'s DER encoding (32 bytes)."""
    return hashlib.sha256(certificate.public_bytes(serialization.Encoding.DER)).digest()


def matches_pin(certificate: x509.Certificate | None, pin: bytes) -> bool:
    """Whether ``certificate`` is the one whose fingerprint was pinned (none presented: no)."""
    return certificate is not None and hmac.compare_digest(certificate_fingerprint(certificate), pin)


def path_configuration(is_client: bool, own: PathCertificate, idle_timeout: float) -> QuicConfiguration:
    """aioquic's settings for one side of a path: pinned certificates, not a chain of trust."""
    return QuicConfiguration(
        is_client=is_client, alpn_protocols=[ALPN], idle_timeout=idle_timeout,
        certificate=own.certificate, private_key=own.private_key, verify_mode=ssl.CERT_NONE,
        max_stream_data=STREAM_WINDOW, max_data=2 * STREAM_WINDOW,
        congestion_control_algorithm=CONGESTION_CONTROL, max_datagram_size=DATAGRAM_SIZE)


class PathConnection(QuicConnection):
    """aioquic's QuicConnection for a path: the server requests the client's certificate, and a
    stream's receive window is ``allowance(stream_id)`` (the highest offset the peer may send),
    or stays where it is when that is None (a stream nobody carries)."""

    def __init__(self, *, allowance: Callable[[int], int | None], **kwargs):
        super().__init__(**kwargs)
        self._allowance = allowance

    def peer_certificate(self) -> x509.Certificate | None:
        """The certificate the peer presented in the handshake (None: it presented none)."""
        return self.tls._peer_certificate

    def unsent(self, stream_id: int, written: int) -> int:
        """Bytes of ``written`` (all the data given for the stream) aioquic has not yet sent once."""
        stream = self._streams.get(stream_id)
        return 0 if stream is None else max(0, written - stream.sender.highest_offset)

    def held(self, stream_id: int) -> int:
        """Bytes aioquic holds for sending on the stream: not yet sent, or sent and not yet acknowledged."""
        stream = self._streams.get(stream_id)
        return 0 if stream is None else len(stream.sender._buffer)

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if not self._is_client:
            self.tls._request_client_certificate = True

    def _write_stream_limits(self, builder, space, stream) -> None:
        """Raise MAX_STREAM_DATA to what the local side consumed plus STREAM_WINDOW (not, as
        aioquic does, to twice what arrived)."""
        allowed = self._allowance(stream.stream_id)
        if allowed is not None and allowed - stream.max_stream_data_local >= WINDOW_STEP:
            stream.max_stream_data_local = allowed
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            buf = builder.start_frame(QuicFrameType.MAX_STREAM_DATA, capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                                      handler=self._on_max_stream_data_delivery, handler_args=(stream,))
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local
