"""Moving a task's data to providers: shards written by the requester, served in checksummed chunks.

A download resumes from the bytes it already holds after a dropped connection and is checked
against the file's SHA-256 at the end. Files are named, never addressed by path: the server
looks names up in its own table and the client writes only into its own folder, so a name like
``../../etc/passwd`` is refused on both sides.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import crc32c
import torch
from safetensors.torch import load_file, save_file

from meshlearn.data import Dataset
from meshlearn.data.vocabulary import BYTES
from meshlearn.network.channel.envelope import BadMessage, NetworkError

log = logging.getLogger(__name__)

# How a download asks for a chunk of shared file NAME: (name, offset, length) -> (the offset the chunk
# starts at, its CRC-32C, its bytes); raises NetworkError. The caller builds it (``data.chunk``, typed).
FetchChunk = Callable[[str, int, int], tuple[int, int, bytes]]

CHUNK_BYTES = 1024 * 1024
MAX_CHUNK_BYTES = 4 * 1024 * 1024
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_TOKENS = BYTES  # a language model's vocabulary at most: token ids are bytes (bytes, or at most 255 characters)


def check_name(name: str) -> str:
    """A shared file's name, refused if it could name anything outside the shared folder."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise BadMessage(f"file name {name!r} is not allowed: letters, digits, '.', '_' and '-' only")
    return name


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class SharedFile:
    """A file offered to providers: where it lies here, its size and SHA-256."""

    path: Path
    size: int
    sha256: str

    def describe(self) -> dict:
        return {"size": self.size, "sha256": self.sha256}


class FileShare:
    """The files a requester serves, by name (``read``: a chunk of one, for its data server's ``data.chunk``)."""

    def __init__(self):
        self.files: dict[str, SharedFile] = {}
        self.chunks_served = 0

    def add(self, name: str, path: Path) -> None:
        path = Path(path)
        self.files[check_name(name)] = SharedFile(path, path.stat().st_size, sha256_of(path))

    def manifest(self) -> dict[str, dict]:
        return {name: f.describe() for name, f in self.files.items()}

    def read(self, name: str, offset: int, length: int) -> tuple[int, int, bytes]:
        """Up to ``length`` bytes (at most ``MAX_CHUNK_BYTES``) of shared file ``name`` from
        ``offset``: (the offset, their CRC-32C, the bytes). BadMessage for a name not shared or an
        offset past its end; NetworkError where the file can no longer be read."""
        shared = self.files.get(check_name(name))
        if shared is None:
            raise BadMessage(f"no shared file named {name!r}")
        length = min(length, MAX_CHUNK_BYTES)
        if offset > shared.size:
            raise BadMessage(f"offset {offset} is past the end of {name} ({shared.size} bytes)")
        try:
            with open(shared.path, "rb") as f:
                f.seek(offset)
                data = f.read(min(length, shared.size - offset))
        except OSError as exc:  # moved or deleted while being served: the caller gets a clear error
            raise NetworkError(f"shared file {name!r} can no longer be read: {exc.strerror or exc}") from None
        self.chunks_served += 1
        return offset, crc32c.crc32c(data), data


def download(fetch_chunk: FetchChunk, name: str, expected: dict, folder: Path, *, source: str = "",
             retries: int = 5, chunk_bytes: int = CHUNK_BYTES, before_chunk: Callable[[], None] | None = None) -> Path:
    """Fetch shared file ``name`` into ``folder`` with ``fetch_chunk``, resuming a partial download;
    return its path (``source``: where it comes from, for errors).

    ``expected`` is the manifest entry (size, sha256). Each chunk's CRC-32C is checked as it
    arrives; the whole file's SHA-256 at the end (a mismatch deletes the partial file).
    ``before_chunk`` runs before every request; what it raises ends the download (a cancelled task).
    """
    name = check_name(name)
    size, sha = _manifest_entry(name, expected)
    folder.mkdir(parents=True, exist_ok=True)
    final, part = folder / name, folder / f"{name}.part"
    if final.exists() and final.stat().st_size == size and sha256_of(final) == sha:
        return final
    failures = 0
    with open(part, "ab") as out:
        while out.tell() < size:
            if before_chunk is not None:
                before_chunk()
            offset = out.tell()
            try:
                at, checksum, data = fetch_chunk(name, offset, chunk_bytes)
            except NetworkError as exc:  # gone, refusing, or its connection dropped mid-handshake
                failures += 1
                if failures > retries:
                    where = f" from {source}" if source else ""
                    raise NetworkError(f"download of {name}{where} failed at byte {offset} of {size} "
                                       f"after {retries} retries: {exc}") from None
                log.warning("download of %s interrupted at byte %d (%s); resuming", name, offset, exc)
                time.sleep(min(2.0, 0.2 * 2 ** failures))
                continue
            if at != offset or checksum != crc32c.crc32c(data) or not data:
                failures += 1
                if failures > retries:
                    raise NetworkError(f"download of {name}: chunk at byte {offset} failed its checksum {retries} times")
                continue
            if offset + len(data) > size:
                raise NetworkError(f"download of {name}: the server sent more than the {size} bytes announced")
            out.write(data)
            failures = 0
        out.flush()
        os.fsync(out.fileno())
    if sha256_of(part) != sha:
        part.unlink()
        raise NetworkError(f"download of {name}: SHA-256 does not match the manifest; the partial file was deleted")
    part.replace(final)
    return final


def _manifest_entry(name: str, expected: object) -> tuple[int, str]:
    """(size, sha256) of a manifest entry that came over the network; BadMessage where it is not one."""
    size, sha = (expected.get("size"), expected.get("sha256")) if isinstance(expected, dict) else (None, None)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str):
        raise BadMessage(f"the manifest's entry for {name} is not a size in bytes and a SHA-256")
    return size, sha


def write_shard(path: Path, x: torch.Tensor, y: torch.Tensor) -> None:
    """Samples and targets as a safetensors file (no pickle): images and int64 labels, or windows
    of byte tokens and the next byte of each (uint8, as stored)."""
    save_file({"x": x.contiguous(), "y": (y if y.ndim > 1 else y.to(torch.int64)).contiguous()}, str(path))


def read_shard(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples and targets from a shard file, validated for shape agreement: images (N, C, H, W)
    with labels (N,), or token windows (N, T) with their next tokens (N, T), both uint8."""
    try:
        tensors = load_file(str(path))
    except Exception as exc:
        raise NetworkError(f"shard {path.name} is not a valid safetensors file: {exc}") from None
    x, y = tensors.get("x"), tensors.get("y")
    images = x is not None and y is not None and x.ndim == 4 and y.ndim == 1 and len(x) == len(y)
    text = x is not None and y is not None and x.ndim == 2 and x.shape == y.shape and \
        x.dtype == y.dtype == torch.uint8
    if set(tensors) != {"x", "y"} or not (images or text):
        raise NetworkError(f"shard {path.name} must hold x (N, C, H, W) and y (N,), or uint8 token windows x and y "
                           "(N, T)")
    return x, y


def dataset_meta(dataset: Dataset) -> dict:
    """What a provider needs to rebuild the dataset around its shard: classes, normalization, task."""
    return {"name": dataset.name, "num_classes": dataset.num_classes, "class_names": list(dataset.class_names),
            "mean": list(dataset.mean), "std": list(dataset.std), "task": dataset.task}


def dataset_from_shards(meta: dict, train: tuple[torch.Tensor, torch.Tensor],
                        test: tuple[torch.Tensor, torch.Tensor]) -> Dataset:
    """A Dataset of a provider's shard and the test set, with the requester's normalization and task
    (a built-in one: a task's code is never named over the network, only selected). NetworkError
    where the description and the samples do not fit together."""
    try:
        name, num_classes = str(meta["name"]), int(meta["num_classes"])
        class_names = tuple(str(c) for c in meta["class_names"])
        mean, std = tuple(float(m) for m in meta["mean"]), tuple(float(s) for s in meta["std"])
        task = str(meta.get("task", "classification"))
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(inf), float(10**400)
        raise NetworkError("the task's data description lacks or garbles its name, num_classes, class_names, mean "
                           "or std") from None
    if task not in ("classification", "language-model"):
        raise NetworkError(f"the task's data is for task {task[:40]!r}: providers train classification or "
                           "language-model")
    if train[0].shape[1:] != test[0].shape[1:] or train[0].dtype != test[0].dtype or train[1].dtype != test[1].dtype:
        raise NetworkError("the task's test samples are not shaped like its training samples")
    if task == "language-model":
        if train[0].ndim != 2 or train[0].shape[1] < 1 or mean or std or not 2 <= num_classes <= MAX_TOKENS or \
                len(class_names) != num_classes:
            raise NetworkError(f"the task's data does not fit a language model: windows of token ids, a vocabulary of "
                               f"2 to {MAX_TOKENS} named tokens")
        for x in (train[0], test[0]):
            if x.numel() and int(x.max()) >= num_classes:
                raise NetworkError(f"tokens outside 0..{num_classes - 1} in the task's data")
    elif train[0].ndim != 4 or not len(mean) == len(std) == train[0].shape[1] or min(std, default=0) <= 0:
        raise NetworkError("the task's data does not fit classification: images (N, C, H, W) with a mean and a "
                           "positive std per channel")
    for y in (train[1], test[1]):
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise NetworkError(f"labels outside 0..{num_classes - 1} in the task's data")
    return Dataset(name, train[0], train[1], test[0], test[1], num_classes, class_names, mean, std, task=task)
