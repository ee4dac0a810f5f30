"""A language model's vocabulary: bytes (256 tokens, every text fits) or the characters of the
training text (at most 255 of them, plus one token for any other character).

Token ids always fit a byte, so text is stored, memory-mapped and shipped to providers as uint8
whichever vocabulary it uses. A run's final model carries its vocabulary in the safetensors
metadata (``metadata``), so ``meshlearn sample`` decodes what the model writes without the data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from meshlearn.data.specs import VocabularyKind
from meshlearn.errors import DatasetError

BYTES = 256
MAX_CHARS = BYTES - 1  # the characters kept; the last id is the unknown character
UNKNOWN = "\ufffd"  # what a character outside the vocabulary reads as, and how its token is written
METADATA_KEY = "meshlearn.vocabulary"


@dataclass(frozen=True)
class Vocabulary:
    """How text becomes token ids and back: ``chars`` None for bytes, else the characters kept,
    in code-point order (token i is ``chars[i]``; token ``len(chars)`` is any other character)."""

    chars: str | None = None

    @property
    def kind(self) -> VocabularyKind:
        """``bytes`` or ``chars``."""
        return "bytes" if self.chars is None else "chars"

    @property
    def size(self) -> int:
        """How many tokens: what the model's output layer scores."""
        return BYTES if self.chars is None else len(self.chars) + 1

    def names(self) -> tuple[str, ...]:
        """Each token as it prints: a printable ASCII byte as itself, other bytes escaped (``\\n``,
        ``\\x00``); a character as itself, the last token as U+FFFD."""
        if self.chars is None:
            return tuple(chr(b) if 32 <= b < 127 else repr(bytes([b]))[2:-1] for b in range(BYTES))
        return (*self.chars, UNKNOWN)

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids (uint8) of text: its UTF-8 bytes, or its characters (bytes decoded as UTF-8,
        a broken sequence read as U+FFFD; a character outside the vocabulary as the last token)."""
        if self.chars is None:
            data = text.encode() if isinstance(text, str) else bytes(text)
            return np.frombuffer(data, dtype=np.uint8).copy()
        points = code_points(text)
        known = np.frombuffer(self.chars.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
        where = np.searchsorted(known, points).clip(max=max(len(known) - 1, 0))
        hit = known[where] == points if len(known) else np.zeros(len(points), dtype=bool)
        return np.where(hit, where, len(known)).astype(np.uint8)

    def decode(self, tokens) -> str:
        """Text of token ids (bytes: decoded as UTF-8, a broken character shown as U+FFFD)."""
        ids = [int(t) for t in tokens]
        if self.chars is None:
            return bytes(ids).decode("utf-8", errors="replace")
        names = self.names()
        return "".join(names[i] for i in ids)

    def metadata(self) -> dict[str, str]:
        """The vocabulary as safetensors metadata (strings only)."""
        return {METADATA_KEY: json.dumps({"kind": self.kind, "chars": self.chars or ""})}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None) -> "Vocabulary":
        """The vocabulary a model file records; bytes for a file that records none (older runs).
        DatasetError for a garbled record."""
        raw = (metadata or {}).get(METADATA_KEY)
        if raw is None:
            return cls()
        try:
            record = json.loads(raw)
            kind, chars = record["kind"], record["chars"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise DatasetError(f"the model file's {METADATA_KEY} is not a vocabulary record") from None
        if kind == "bytes":
            return cls()
        if kind != "chars":
            raise DatasetError(f"the model file's {METADATA_KEY} names vocabulary {str(kind)[:20]!r}, not bytes or "
                               "chars")
        return cls.from_chars(chars)

    @classmethod
    def from_chars(cls, chars: str) -> "Vocabulary":
        """A character vocabulary, validated: distinct characters in code-point order, at most 255."""
        if not isinstance(chars, str) or not 0 < len(chars) <= MAX_CHARS or list(chars) != sorted(set(chars)):
            raise DatasetError(f"a character vocabulary is 1 to {MAX_CHARS} distinct characters in code-point order")
        return cls(chars)

    @classmethod
    def of_text(cls, kind: VocabularyKind, training: list[str]) -> "Vocabulary":
        """The vocabulary ``kind`` makes of the training text: bytes, or its characters (the 255
        most frequent where there are more; ties go to the lower code point)."""
        if kind == "bytes":
            return cls()
        if kind != "chars":
            raise DatasetError(f"vocabulary {kind!r}: use bytes or chars")
        points, counts = np.unique(np.concatenate([code_points(t) for t in training] or [np.zeros(0, np.uint32)]),
                                   return_counts=True)
        if not len(points):
            raise DatasetError("a character vocabulary needs training text: it has none")
        kept = np.sort(points[np.argsort(-counts, kind="stable")[:MAX_CHARS]])
        return cls("".join(chr(p) for p in kept))

    @classmethod
    def of_names(cls, names: tuple[str, ...]) -> "Vocabulary":
        """The vocabulary whose ``names()`` these are (a dataset's ``class_names``)."""
        if names == cls().names():
            return cls()
        if not names or names[-1] != UNKNOWN or any(len(n) != 1 for n in names):
            raise DatasetError("these token names are neither the byte vocabulary nor a character one")
        return cls.from_chars("".join(names[:-1]))


def code_points(text: str | bytes) -> np.ndarray:
    """The Unicode code points of text (bytes decoded as UTF-8, a broken sequence as U+FFFD)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", errors="replace")
    return np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)


def model_metadata(dataset) -> dict[str, str]:
    """What a run's model file records of its dataset: a language model's vocabulary (nothing for
    images, or for a user's text dataset whose token names are neither vocabulary)."""
    if not dataset.tokens:
        return {}
    try:
        return Vocabulary.of_names(tuple(dataset.class_names)).metadata()
    except DatasetError:
        return {}
