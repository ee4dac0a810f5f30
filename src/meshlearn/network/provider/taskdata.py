"""A provider's data for a task: its shard and the test set, served by the requester or held locally;
and how its files travel to and from the requester's data server (chunks of shared files, checkpoints)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshlearn.data import Dataset, load_dataset, partition_dataset
from meshlearn.errors import BadMessage
from meshlearn.network.protocol.requesterapi import Checkpoint, Chunk
from meshlearn.network.protocol.rpcs import DATA_CHUNK, TASK_CHECKPOINT
from meshlearn.network.protocol.serving import ask_with_blobs
from meshlearn.network.task.datashare import (
    FetchChunk,
    dataset_from_shards,
    download,
    read_shard,
)
from meshlearn.network.task.spec import TaskSpec
from meshlearn.network.task.state import CHECKPOINT_TIMEOUT, SendCheckpoint

CHUNK_TIMEOUT = 10.0  # seconds the requester's data server may take to send one chunk
CHECKPOINT_REPLY_BYTES = 1 << 20  # what a checkpoint's reply may take beyond the checkpoint's own size


def chunk_source(address: str, secret: bytes, sender: str, timeout: float = CHUNK_TIMEOUT) -> FetchChunk:
    """``download``'s fetch: chunks of the files the data server at ``address`` shares (``data.chunk``),
    asked as ``sender``; raises NetworkError (BadMessage for a reply that does not fit)."""

    def fetch(name: str, offset: int, length: int) -> tuple[int, int, bytes]:
        reply, blobs = ask_with_blobs(address, DATA_CHUNK, Chunk(name=name, offset=offset, length=length), secret,
                                      timeout=timeout, sender=sender)
        return reply.offset, reply.crc32c, bytes(blobs[0])
    return fetch


def checkpoint_sender(address: str, task: str, index: int, secret: bytes, sender: str) -> SendCheckpoint:
    """``SentCheckpoints``' send: provider ``index``'s checkpoint of a cycle (its JSON and its tensors)
    to the requester of ``task`` at ``address`` (``task.checkpoint``); raises NetworkError."""

    def send(cycle: int, files: list[bytes]) -> None:
        ask_with_blobs(address, TASK_CHECKPOINT, Checkpoint(task=task, index=index, cycle=cycle), secret,
                       blobs=files, timeout=CHECKPOINT_TIMEOUT, sender=sender,
                       max_bytes=sum(len(f) for f in files) + CHECKPOINT_REPLY_BYTES)
    return send


def task_dataset(spec: TaskSpec, index: int, folder: Path, secret: bytes, sender: str, data_root: Path | None,
                 before_chunk: Callable[[], None] | None = None) -> tuple[Dataset, list[int]]:
    """The dataset provider ``index`` trains on and the indices of its shard in it (``spec.shard_of``).

    Served data is downloaded into ``folder`` (``before_chunk`` runs before every chunk: what it
    raises ends the download); local data must lie under ``data_root``.
    """
    data = spec.data
    mode = data.get("mode")
    shard_index = spec.shard_of(index)
    if mode == "served":
        address, files = str(data.get("address", "")), data.get("files")
        name = f"shard-{shard_index}.safetensors"
        if not isinstance(files, dict) or name not in files or "test.safetensors" not in files or spec.meta is None:
            raise BadMessage("served data must list this provider's shard and test.safetensors, with meta")
        fetch = chunk_source(address, secret, sender)
        shard, test = (download(fetch, file, files[file], folder, source=address, before_chunk=before_chunk)
                       for file in (name, "test.safetensors"))
        dataset = dataset_from_shards(spec.meta, read_shard(shard), read_shard(test))
        if dataset.tokens and dataset.input_shape != (spec.context,):
            raise BadMessage(f"the task's token windows are {dataset.input_shape[0]} long, not its context "
                             f"{spec.context}")
        return dataset, list(range(len(dataset.train_y)))
    if mode == "local":
        dataset = load_dataset(allowed_local(str(data.get("dataset", "")), data_root), context=spec.context,
                               vocabulary=spec.vocabulary)
        parts = partition_dataset(dataset, spec.shards, spec.partition, spec.seed)
        return dataset, parts[shard_index]
    raise BadMessage(f"data mode {mode!r} is not served or local")


def allowed_local(dataset: str, root: Path | None) -> str:
    """A dataset on this machine, only inside the folder the operator allowed (``--data-root``)."""
    kind, sep, path = dataset.partition(":")
    if not sep:
        return dataset  # an embedded dataset such as digits
    if root is None:
        raise BadMessage("this provider serves no local data: its operator did not pass --data-root")
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise BadMessage(f"local data {path!r} is outside this provider's data root")
    return f"{kind}:{resolved}"
