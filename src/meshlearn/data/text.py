"""Text datasets for language models: the running Python's standard library (``pystdlib``, needs no
download) and a user's text (``text:PATH``), as windows of byte tokens.

A corpus is a list of files in a fixed order. Every tenth file (the 10th, 20th, ...; of fewer than
ten, the last) is held out for testing, so the test set is text no node trained on; a single file
is split at nine tenths of its bytes instead. Each side's bytes, one file after another, are one token stream, decoded once
per machine into the cache and memory-mapped. A sample is a window of ``context`` tokens (``x``)
and the same window one token on (``y``: the next token at every position); windows do not
overlap. ``train_groups`` says the file each training window starts in, so partition ``writers``
gives each node whole files (non-IID by module), and ``iid`` deals windows out at random.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from meshlearn.data.datasets import Dataset, _cache_root, _file_key, _tensor
from meshlearn.errors import DatasetError

HELD_OUT_EVERY = 10  # every 10th file of a corpus is a test file
SKIPPED = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}  # not the library's own code
BYTES = 256  # the vocabulary: one token per byte value
DEFAULT_CONTEXT = 128
CACHE_FORMAT = 1  # raise when what the cache holds, or how it is split, changes


def byte_names() -> tuple[str, ...]:
    """The tokens' names: the character of a printable ASCII byte, else its escape (``\\n``, ``\\x00``)."""
    return tuple(chr(b) if 32 <= b < 127 else repr(bytes([b]))[2:-1] for b in range(BYTES))


def stdlib_root() -> Path:
    """The running interpreter's standard library folder (its ``Lib``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's own ``.py`` files (not its tests, caches or installed packages),
    sorted by their path inside the library: the same list and order for a given Python version."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not SKIPPED & set(p.relative_to(root).parts) and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_files(path: Path) -> list[Path]:
    """A file, or a folder's ``.txt`` files (at any depth) sorted by their path inside it."""
    if path.is_file():
        return [path]
    files = sorted((p for p in path.rglob("*.txt") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise DatasetError(f"text dataset {path}: no .txt files in it: give a text file, or a folder of .txt files")
    return files


def load_pystdlib(context: int = DEFAULT_CONTEXT) -> Dataset:
    """The running Python's standard library as a byte-level language-modelling corpus."""
    files = stdlib_files()
    version = f"python {sys.version_info.major}.{sys.version_info.minor}"
    return _corpus("pystdlib", files, context, f"{version}\n{_file_key(*files)}")


def load_text(path: str | Path, context: int = DEFAULT_CONTEXT) -> Dataset:
    """A text file, or a folder of ``.txt`` files, as a byte-level language-modelling corpus."""
    files = text_files(Path(path))
    return _corpus("text", files, context, _file_key(*files))


def split_files(files: list[Path]) -> tuple[list[int], list[int]]:
    """The positions of the training files and of the held-out ones: every ``HELD_OUT_EVERY``-th,
    or of fewer files, the last one."""
    test = [i for i in range(len(files)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1] or [len(files) - 1]
    return [i for i in range(len(files)) if i not in test], test


def _corpus(name: str, files: list[Path], context: int, key: str) -> Dataset:
    if context < 2:
        raise DatasetError(f"context {context}: a language model needs windows of at least 2 tokens")
    train, test, starts = _token_streams(name, files, key)
    for side, tokens in (("training", train), ("test", test)):
        if len(tokens) <= context:
            raise DatasetError(f"dataset {name}: its {side} text has {len(tokens)} bytes, too few for one window of "
                               f"{context} tokens: give more text, or a shorter --context")
    train_x, train_y = windows(train, context)
    test_x, test_y = windows(test, context)
    groups = np.searchsorted(starts, np.arange(len(train_x), dtype=np.int64) * context, side="right") - 1
    return Dataset(name=name, train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y, num_classes=BYTES,
                   class_names=byte_names(), mean=(), std=(), train_groups=torch.from_numpy(groups),
                   task="language-model")


def windows(tokens: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of ``context`` tokens, and the same windows one token on: views of
    ``tokens``, no copy."""
    count = (len(tokens) - 1) // context
    stream = _tensor(np.asarray(tokens))
    return stream[:count * context].view(count, context), stream[1:count * context + 1].view(count, context)


def _token_streams(name: str, files: list[Path], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The training and test token streams (memory-mapped from the cache, built there once) and
    where each training file starts in its stream."""
    key = f"format {CACHE_FORMAT}|held out every {HELD_OUT_EVERY}|{sorted(SKIPPED)}\n{key}"
    cache = _cache_root() / f"text-{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    names = ("train", "test", "starts")
    if not all((cache / f"{n}.npy").is_file() for n in names):
        train_files, test_files = split_files(files) if len(files) > 1 else ([0], [])
        train_parts = [_read(files[i]) for i in train_files]
        test_parts = [_read(files[i]) for i in test_files]
        if len(files) == 1:  # one file: its last tenth is the test text
            cut = len(train_parts[0]) * (HELD_OUT_EVERY - 1) // HELD_OUT_EVERY
            train_parts, test_parts = [train_parts[0][:cut]], [train_parts[0][cut:]]
        starts = np.cumsum([0] + [len(p) for p in train_parts[:-1]], dtype=np.int64)
        cache.mkdir(parents=True, exist_ok=True)
        for n, array in zip(names, (_joined(train_parts), _joined(test_parts), starts)):
            tmp = cache / f"{n}.{os.getpid()}.tmp.npy"
            np.save(tmp, array)
            tmp.replace(cache / f"{n}.npy")
        (cache / "files.json").write_text(json.dumps([str(f) for f in files]))
    return tuple(np.load(cache / f"{n}.npy", mmap_mode="r") for n in names)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"text file {path} cannot be read: {exc.strerror}") from None


def _joined(parts: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(parts), dtype=np.uint8).copy()
