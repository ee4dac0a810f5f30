"""Text datasets for language models: the running Python's standard library (``pystdlib``, needs no
download), a user's text (``text:PATH``) and LEAF's Shakespeare (``leaf:DIR``), as windows of tokens.

A corpus is a list of files in a fixed order. Every tenth file (the 10th, 20th, ...; of fewer than
ten, the last) is held out for testing, so the test set is text no node trained on; a single file
is split at nine tenths of its bytes instead. In LEAF's Shakespeare each writer's (a speaking
character's) lines are one text, rebuilt from its sliding 80-character samples; LEAF's test
writers are held out, or where LEAF split each writer's samples, every tenth writer. Each side's text,
one file (writer) after another, is one token stream of the vocabulary (``data.vocabulary``:
bytes, or the training text's characters), tokenized once per machine into the cache and
memory-mapped. A sample is a window of ``context`` tokens (``x``) and the same window one token on
(``y``: the next token at every position); windows do not overlap. ``train_groups`` says the file
(writer) each training window starts in, so partition ``writers`` gives each node whole files
(non-IID by module, or by speaker), and ``iid`` deals windows out at random.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from meshlearn.data.datasets import Dataset, _cache_root, _file_key, _tensor
from meshlearn.data.leaf import leaf_folders, leaf_records
from meshlearn.data.vocabulary import METADATA_KEY, Vocabulary, VocabularyKind
from meshlearn.errors import DatasetError

HELD_OUT_EVERY = 10  # every 10th file of a corpus is a test file
SKIPPED = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}  # not the library's own code
DEFAULT_CONTEXT = 128
CACHE_FORMAT = 2  # raise when what the cache holds, or how it is split, changes
LEAF_SNIFF_BYTES = 1 << 20  # how much of a LEAF file is read to tell text samples from pixel lists
Texts = tuple[list[bytes | str], list[bytes | str]]  # the training texts (one a file or writer) and the test ones


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


def load_pystdlib(context: int = DEFAULT_CONTEXT, vocabulary: VocabularyKind = "bytes") -> Dataset:
    """The running Python's standard library as a language-modelling corpus."""
    files = stdlib_files()
    version = f"python {sys.version_info.major}.{sys.version_info.minor}"
    return _corpus("pystdlib", f"{version}\n{_file_key(*files)}", lambda: _file_texts(files), context, vocabulary)


def load_text(path: str | Path, context: int = DEFAULT_CONTEXT, vocabulary: VocabularyKind = "bytes") -> Dataset:
    """A text file, or a folder of ``.txt`` files, as a language-modelling corpus."""
    files = text_files(Path(path))
    return _corpus("text", _file_key(*files), lambda: _file_texts(files), context, vocabulary)


def leaf_holds_text(path: str | Path) -> bool:
    """Whether a LEAF folder holds text samples (Shakespeare: ``x`` a list of strings) rather than
    pixel lists (FEMNIST), told from the start of its first training file (read whole only where
    that start does not say)."""
    first = min(Path(path, "train").glob("*.json"), default=None)
    if first is None:
        return False
    with open(first, "rb") as handle:
        head = handle.read(LEAF_SNIFF_BYTES)
    found = re.search(rb'"x"\s*:\s*\[\s*(["\[\d.-])', head)
    if found:
        return found.group(1) == b'"'
    for _, _, record in leaf_records(first.parent):
        samples = record.get("x") if isinstance(record, dict) else None
        return isinstance(samples, list) and bool(samples) and isinstance(samples[0], str)
    return False


def load_leaf_text(path: str | Path, context: int = DEFAULT_CONTEXT, vocabulary: VocabularyKind = "bytes") -> Dataset:
    """LEAF's Shakespeare (``train/*.json``, ``test/*.json``, each ``user_data: {writer: {x: [80
    characters], y: [the next one]}}``) as a language-modelling corpus: each writer's samples
    rebuilt into its text, writers as the groups (partition ``writers``).

    LEAF splits Shakespeare by writer (``-t user``: its test writers are the test text) or by sample
    (the default: each writer's windows dealt to both sides, so test windows are lines the training
    text holds). Where a writer is on both sides, its test samples are dropped and every tenth
    writer (of fewer than ten, the last) is held out instead, as files are: the test text is text
    no node trained on."""
    root = Path(path)
    folders = leaf_folders(root)
    files = [*sorted(folders[0].glob("*.json")), *sorted(folders[1].glob("*.json"))]
    return _corpus("leaf-text", _file_key(*files), lambda: _leaf_split(folders), context, vocabulary)


MIN_OVERLAP = 4  # characters a sample must share with the text so far to be read as overlapping it


def leaf_writer_text(samples: list[str], following: list[str]) -> str:
    """A writer's text from LEAF's sliding samples: a sample that overlaps the end of the text so far
    (the next window, one character on; or a later one, where a split by sample left a gap) adds
    what goes past the overlap and its next character; one that does not adds itself and its next
    character."""
    parts, tail = [], ""  # tail: the last characters written, a window and one long
    for x, y in zip(samples, following):
        shared = _overlap(tail, x)
        piece = x[shared:] + y
        parts.append(piece)
        tail = (tail + piece)[-(len(x) + 1):]
    return "".join(parts)


def _overlap(tail: str, window: str) -> int:
    """The longest start of ``window`` (at least MIN_OVERLAP characters) that ``tail`` ends with, or 0."""
    for size in range(min(len(tail), len(window)), MIN_OVERLAP - 1, -1):
        if tail.endswith(window[:size]):
            return size
    return 0


def _leaf_split(folders: list[Path]) -> Texts:
    train, test = (_leaf_texts(folder) for folder in folders)
    if {writer for writer, _ in train} & {writer for writer, _ in test}:  # LEAF's split by sample
        texts = [text for _, text in train]
        kept, held_out = split_files(texts)
        return [texts[i] for i in kept], [texts[i] for i in held_out]
    return [text for _, text in train], [text for _, text in test]


def _leaf_texts(folder: Path) -> list[tuple[str, str]]:
    texts = []
    for path, user, record in leaf_records(folder):
        samples = record.get("x") if isinstance(record, dict) else None
        following = record.get("y") if isinstance(record, dict) else None
        if not isinstance(samples, list) or not isinstance(following, list) or len(samples) != len(following) or \
                not all(isinstance(t, str) for t in samples + following):
            raise DatasetError(f"{path}: writer {user!r} needs as many text samples (x, strings) as next characters "
                               "(y, strings)")
        texts.append((user, leaf_writer_text(samples, following)))
    return texts


def _file_texts(files: list[Path]) -> Texts:
    if len(files) == 1:  # one file: its last tenth is the test text
        data = _read(files[0])
        cut = len(data) * (HELD_OUT_EVERY - 1) // HELD_OUT_EVERY
        return [data[:cut]], [data[cut:]]
    train, test = split_files(files)
    return [_read(files[i]) for i in train], [_read(files[i]) for i in test]


def split_files(files: Sequence[object]) -> tuple[list[int], list[int]]:
    """The positions of the training files (or writers' texts) and of the held-out ones: every
    ``HELD_OUT_EVERY``-th, or of fewer files, the last one."""
    test = [i for i in range(len(files)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1] or [len(files) - 1]
    return [i for i in range(len(files)) if i not in test], test


def _corpus(name: str, key: str, read: Callable[[], Texts], context: int, vocabulary: VocabularyKind) -> Dataset:
    if context < 2:
        raise DatasetError(f"context {context}: a language model needs windows of at least 2 tokens")
    train, test, starts, vocab = _token_streams(name, key, read, vocabulary)
    for side, tokens in (("training", train), ("test", test)):
        if len(tokens) <= context:
            raise DatasetError(f"dataset {name}: its {side} text has {len(tokens)} tokens, too few for one window of "
                               f"{context}: give more text, or a shorter --context")
    train_x, train_y = windows(train, context)
    test_x, test_y = windows(test, context)
    groups = np.searchsorted(starts, np.arange(len(train_x), dtype=np.int64) * context, side="right") - 1
    return Dataset(name=name, train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y, num_classes=vocab.size,
                   class_names=vocab.names(), mean=(), std=(), train_groups=torch.from_numpy(groups),
                   task="language-model")


def windows(tokens: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of ``context`` tokens, and the same windows one token on: views of
    ``tokens``, no copy."""
    count = (len(tokens) - 1) // context
    stream = _tensor(np.asarray(tokens))
    return stream[:count * context].view(count, context), stream[1:count * context + 1].view(count, context)


def _token_streams(name: str, key: str, read: Callable[[], Texts],
                   kind: VocabularyKind) -> tuple[np.ndarray, np.ndarray, np.ndarray, Vocabulary]:
    """The training and test token streams (memory-mapped from the cache, built there once), where
    each training text starts in its stream, and the vocabulary."""
    key = f"format {CACHE_FORMAT}|held out every {HELD_OUT_EVERY}|{sorted(SKIPPED)}|vocabulary {kind}\n{key}"
    cache = _cache_root() / f"text-{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    names = ("train", "test", "starts")
    if not all((cache / f"{n}.npy").is_file() for n in names) or not (cache / "vocabulary").is_file():
        train_texts, test_texts = read()
        if kind == "chars":  # characters: each text decoded once, here
            train_texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in train_texts]
        vocab = Vocabulary.of_text(kind, train_texts)
        train_parts = [vocab.encode(t) for t in train_texts]
        starts = np.cumsum([0] + [len(p) for p in train_parts[:-1]], dtype=np.int64)
        cache.mkdir(parents=True, exist_ok=True)
        for n, array in zip(names, (_joined(train_parts), _joined([vocab.encode(t) for t in test_texts]), starts)):
            tmp = cache / f"{n}.{os.getpid()}.tmp.npy"
            np.save(tmp, array)
            tmp.replace(cache / f"{n}.npy")
        tmp = cache / f"vocabulary.{os.getpid()}.tmp"
        tmp.write_text(vocab.metadata()[METADATA_KEY])
        tmp.replace(cache / "vocabulary")
    vocab = Vocabulary.from_metadata({METADATA_KEY: (cache / "vocabulary").read_text()})
    return (*(np.load(cache / f"{n}.npy", mmap_mode="r") for n in names), vocab)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"text file {path} cannot be read: {exc.strerror}") from None


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
