"""The bodies of the requests a requester's data server answers, and of its replies (declared in ``rpcs``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from meshlearn.network.protocol.message import Count, Message, TaskId

MAX_OFFSET = 1 << 50  # the largest offset into a shared file


class Chunk(Message):
    """A chunk of the shared file ``name``: ``length`` bytes from ``offset``."""

    name: Annotated[str, Field(min_length=1, max_length=128)]
    offset: Annotated[int, Field(ge=0, le=MAX_OFFSET)]
    length: Annotated[int, Field(ge=1, lt=1 << 31)] = 1024 * 1024


class ChunkData(Message):
    """Where the chunk (the one blob) starts, and its CRC-32C."""

    offset: Annotated[int, Field(ge=0, le=MAX_OFFSET)]
    crc32c: Annotated[int, Field(ge=0, lt=1 << 32)]


class Checkpoint(Message):
    """A provider's checkpoint of a cycle: two blobs, its JSON and its tensors."""

    task: TaskId
    index: Count
    cycle: Annotated[int, Field(ge=1, lt=1 << 31)]


class CheckpointKept(Message):
    kept: Annotated[int, Field(ge=1, lt=1 << 31)]
