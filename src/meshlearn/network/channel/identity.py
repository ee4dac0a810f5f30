"""Who a network participant is: a long-term CurveZMQ key pair, kept in a file only its owner reads.

A public key travels as 43 characters of URL-safe base64 (``KEY``); an address may carry the key
its holder must prove: ``HOST:PORT@KEY``. Every connection of the network mode is a CurveZMQ
session (X25519 + XSalsa20-Poly1305, libzmq and libsodium): a client connects only to the key it
was given, and a server learns the client's key from the handshake.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.utils.z85

from meshlearn.errors import BadMessage, UserInputError

KEY_BYTES = 32


def key_text(key: bytes) -> str:
    """A public key as users see and paste it (43 URL-safe base64 characters)."""
    return base64.urlsafe_b64encode(key).rstrip(b"=").decode()


def key_from_text(text: str, what: str = "key") -> bytes:
    """The 32 bytes of a key written by ``key_text``; UserInputError names what is wrong."""
    if not isinstance(text, str) or len(text) != 43:
        raise UserInputError(f"{what} {text!r} is not a meshlearn public key (43 characters, as printed at start)")
    try:
        raw = base64.urlsafe_b64decode(text + "=")
    except (binascii.Error, ValueError):
        raise UserInputError(f"{what} {text!r} is not a meshlearn public key (URL-safe base64)") from None
    if len(raw) != KEY_BYTES or key_text(raw) != text:
        raise UserInputError(f"{what} {text!r} is not a meshlearn public key (URL-safe base64)")
    return raw


def peer_key(text: object, what: str = "key") -> bytes:
    """A key that came over the network: BadMessage (not a user error) if it is not one."""
    try:
        return key_from_text(text, what)  # type: ignore[arg-type]
    except UserInputError as exc:
        raise BadMessage(str(exc)) from None


def split_pinned(address: str) -> tuple[str, bytes | None]:
    """``HOST:PORT@KEY`` into the address and the key it pins (None without ``@``)."""
    plain, sep, key = address.rpartition("@")
    if not sep:
        return address, None
    return plain, key_from_text(key, f"the key in {address!r}")


def key_in(address: str) -> str:
    """The key a ``HOST:PORT@KEY`` address pins, as printed ("" if it pins none)."""
    plain, sep, key = address.rpartition("@")
    return key if sep else ""


def pinned(address: str, key: bytes | None) -> str:
    """``address`` with ``key`` attached (as is if ``key`` is None)."""
    return address if key is None else f"{address}@{key_text(key)}"


KEY_FILE_HEADER = "meshlearn-key 1"
HOME_ENV = "MESHLEARN_HOME"


def state_home() -> Path:
    """Where a participant keeps its keys and known bootstraps: ``$MESHLEARN_HOME``, else ~/.meshlearn."""
    return Path(os.environ.get(HOME_ENV) or "~/.meshlearn").expanduser()
__all__ = ["KeyPair", "fingerprint", "key_from_text", "key_in", "key_text", "load_or_create_key", "own_identity",
           "peer_key", "pinned", "split_pinned", "state_home", "use_identity"]


def fingerprint(key: bytes) -> str:
    """A short digest of a public key, to compare by eye (``SHA256:`` and 16 characters)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key).digest()).decode()[:16]


@dataclass(frozen=True)
class KeyPair:
    """A CurveZMQ key pair: ``public`` is shown to everyone, ``secret`` never leaves its file."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(zmq.utils.z85.decode(public), zmq.utils.z85.decode(secret))

    @property
    def text(self) -> str:
        return key_text(self.public)

    def describe(self) -> str:
        """What a service prints at start: the key to pin, and its fingerprint."""
        return f"public key {self.text} ({fingerprint(self.public)})"


def load_or_create_key(path: str | Path) -> tuple[KeyPair, bool]:
    """The key pair in ``path``, made (mode 0600, folder 0700) if the file does not exist; and
    whether it was made now. A key file others can read is refused, as SSH does."""
    path = Path(path).expanduser()
    if not path.exists():
        pair = KeyPair.generate()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise UserInputError(f"--key {path}: cannot make its folder {path.parent} ({exc.strerror or exc}): "
                                 "give a path in a folder you can write") from None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return load_or_create_key(path)  # another process made it first
        except OSError as exc:
            raise UserInputError(f"--key {path}: cannot create it ({exc.strerror}): give a path you can write") \
                from None
        with os.fdopen(fd, "w") as f:
            f.write(f"{KEY_FILE_HEADER}\npublic {key_text(pair.public)}\nsecret {key_text(pair.secret)}\n")
        return pair, True
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise UserInputError(f"--key {path}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserInputError(f"key file {path} can be read by others (mode {stat.S_IMODE(mode):o}): "
                             f"run chmod 600 {path}")
    fields = dict(line.split(" ", 1) for line in text.splitlines()[1:] if " " in line)
    if not text.startswith(KEY_FILE_HEADER) or not {"public", "secret"} <= fields.keys():
        raise UserInputError(f"{path} is not a meshlearn key file: give another --key (a missing file is created)")
    public = key_from_text(fields["public"].strip(), f"the public key in {path}")
    secret = key_from_text(fields["secret"].strip(), f"the secret key in {path}")
    derived = zmq.utils.z85.decode(zmq.curve_public(zmq.utils.z85.encode(secret)))
    if derived != public:
        raise UserInputError(f"key file {path} is damaged (its public key does not match its secret key)")
    return KeyPair(public, secret), False


_identity: KeyPair | None = None


def use_identity(pair: KeyPair) -> None:
    """Make ``pair`` this process's key: the one its calls prove, and its services hold."""
    global _identity
    _identity = pair


def own_identity() -> KeyPair:
    """This process's key pair (a throwaway one if no service set one: a one-off client)."""
    global _identity
    if _identity is None:
        _identity = KeyPair.generate()
    return _identity
