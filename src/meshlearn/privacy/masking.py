"""The primitives of secure aggregation, all from well-kept libraries: X25519 key agreement and
HKDF-SHA256 (``cryptography``) for pairwise seeds, ChaCha20's key stream (``cryptography``) as the
mask generator, AES-GCM (``cryptography``) to seal a secret share for its one recipient, and
Shamir's secret sharing over GF(2^128) (``pycryptodome``, as Flower's SecAgg+ uses).

Models are summed in the ring of integers modulo 2^64 (numpy ``uint64`` arithmetic, which wraps by
definition): a value is encoded as a fixed-point integer with ``FRACTION_BITS`` bits after the point,
so a sum of encoded values decodes to the sum of the values to within n * 2^-(FRACTION_BITS + 1),
as long as the sum's magnitude stays below 2^(63 - FRACTION_BITS) (about 8.8e12).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from meshlearn.errors import WireError

FRACTION_BITS = 20
SCALE = float(2 ** FRACTION_BITS)
RING_LIMIT = 2.0 ** (62 - FRACTION_BITS)  # the largest sum of magnitudes the fixed point holds (with a bit to spare)
KEY_BYTES = 32  # an X25519 public key, a private key, a seed
SHARE_BYTES = 2 + 2 * 16  # a Shamir share of a 32-byte secret: its index (u16), then the shares of both halves
_NONCE = 12
SEALED_BYTES = 4 + 4 + _NONCE + SHARE_BYTES + 16  # from, to, nonce, ciphertext with its tag
OPEN_BYTES = 4 + SHARE_BYTES  # from, the share in the clear (what a member reveals to the leader)
_RECORD = struct.Struct("<II")
_CONTEXT = struct.Struct("<BqII")


def encode(values: np.ndarray) -> np.ndarray:
    """``values`` (floats) as fixed-point integers in the ring of 2^64 (``uint64``)."""
    return np.rint(np.asarray(values, dtype=np.float64) * SCALE).astype(np.int64).view(np.uint64)


def decode(ring: np.ndarray) -> np.ndarray:
    """A sum of ``encode``d values (``uint64``) back as float64."""
    return ring.view(np.int64).astype(np.float64) / SCALE


def stream(seed: bytes, length: int) -> np.ndarray:
    """``length`` pseudo-random ring elements (``uint64``) from a 32-byte ``seed``: ChaCha20's key
    stream with a zero nonce (every seed is used for one mask only)."""
    if len(seed) != KEY_BYTES:
        raise ValueError(f"a mask seed is {KEY_BYTES} bytes, not {len(seed)}")
    encryptor = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * length)), dtype=np.uint64).copy()


def new_seed() -> bytes:
    """A fresh 32-byte secret from the operating system's generator."""
    return os.urandom(KEY_BYTES)


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair; ``public`` is its 32 raw bytes."""

    private: X25519PrivateKey
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        """A fresh key pair."""
        private = X25519PrivateKey.generate()
        return cls(private, private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    @classmethod
    def from_private(cls, raw: bytes) -> KeyPair:
        """The key pair of a 32-byte private key (one rebuilt from shares)."""
        private = X25519PrivateKey.from_private_bytes(raw)
        return cls(private, private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    def private_bytes(self) -> bytes:
        """The private key's 32 raw bytes (what is secret-shared)."""
        return self.private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def agree(self, peer_public: bytes, info: bytes) -> bytes:
        """A 32-byte secret only this key and ``peer_public``'s owner can make: HKDF-SHA256 of
        their X25519 agreement, bound to ``info``."""
        if len(peer_public) != KEY_BYTES:
            raise WireError(f"a public key is {KEY_BYTES} bytes, not {len(peer_public)}")
        try:
            shared = self.private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError as error:  # a low-order point: an all-zero agreement
            raise WireError(f"a public key that agrees on nothing: {error}") from None
        return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def check_public(public: bytes) -> bytes:
    """``public`` where it is an X25519 public key anyone can agree with; a WireError where it is not
    32 bytes or is a low-order point (every agreement with it would be all zeros)."""
    KeyPair.generate().agree(public, b"meshlearn-check")
    return public


def split(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """Shamir shares of a 32-byte ``secret``: ``count`` of them, any ``threshold`` of which rebuild
    it (each ``SHARE_BYTES``: its index, then a share of each 16-byte half)."""
    from Crypto.Protocol.SecretSharing import Shamir

    if len(secret) != KEY_BYTES:
        raise ValueError(f"a shared secret is {KEY_BYTES} bytes, not {len(secret)}")
    halves = [Shamir.split(threshold, count, secret[i:i + 16]) for i in (0, 16)]
    return [struct.pack("<H", first[0]) + first[1] + second[1] for first, second in zip(*halves)]


def combine(shares: list[bytes]) -> bytes:
    """The secret ``split`` made, from at least its threshold of distinct shares."""
    from Crypto.Protocol.SecretSharing import Shamir

    parsed = {}
    for share in shares:
        if len(share) != SHARE_BYTES:
            raise WireError(f"a secret share is {SHARE_BYTES} bytes, not {len(share)}")
        index = struct.unpack_from("<H", share)[0]
        if index == 0:
            raise WireError("a secret share with index 0")
        parsed[index] = share
    ordered = sorted(parsed.items())
    return b"".join(Shamir.combine([(index, share[2 + 16 * half:18 + 16 * half]) for index, share in ordered])
                    for half in (0, 1))


def _context(kind: int, cycle: int, sender: int, recipient: int) -> bytes:
    return b"meshlearn-secagg-share" + _CONTEXT.pack(kind, cycle, sender, recipient)


def seal(key: bytes, kind: int, cycle: int, sender: int, recipient: int, share: bytes) -> bytes:
    """``share`` sealed (AES-GCM under ``key``, the pair's share key) for ``recipient`` alone, bound
    to what it is (``kind``, ``cycle``, who made it): ``SEALED_BYTES``."""
    nonce = os.urandom(_NONCE)
    return _RECORD.pack(sender, recipient) + nonce + AESGCM(key).encrypt(nonce, share,
                                                                          _context(kind, cycle, sender, recipient))


def record_parties(record: bytes) -> tuple[int, int]:
    """Who sealed a record and for whom."""
    if len(record) != SEALED_BYTES:
        raise WireError(f"a sealed share is {SEALED_BYTES} bytes, not {len(record)}")
    return _RECORD.unpack_from(record)


def unseal(key: bytes, kind: int, cycle: int, record: bytes) -> tuple[int, bytes]:
    """The sender and the share of a ``seal``ed record; a WireError where it does not open (not
    for this key, this kind or this cycle, or altered)."""
    sender, recipient = record_parties(record)
    nonce = record[8:8 + _NONCE]
    try:
        share = AESGCM(key).decrypt(nonce, record[8 + _NONCE:], _context(kind, cycle, sender, recipient))
    except InvalidTag:
        raise WireError(f"a sealed share from {sender} that does not open") from None
    return sender, share
