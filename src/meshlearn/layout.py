"""The byte layout of a message's tensors, for transports that cut messages into chunks (UDP).

A ``TensorLayout`` names a message's tensors, their dtypes and sizes, and where each lies in the
message's bytes. Sender and receiver agree on it before the run (a model's flat state: one dtype,
in segments; a sharing scheme's message: values, positions, scales of their own dtypes), so a
datagram carries no tensor names. A receiver reassembles the bytes, reads the tensors as views
of them and, when chunks were lost, asks which elements of each tensor arrived (``presence``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from meshlearn.errors import WireError


@dataclass(frozen=True)
class Segment:
    """One tensor of a layout: ``numel`` values of ``dtype`` from byte ``offset`` of the message."""

    name: str
    dtype: torch.dtype
    numel: int
    offset: int

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def stop(self) -> int:
        """The byte after the segment's last."""
        return self.offset + self.numel * self.itemsize


class TensorLayout:
    """The named tensors of every message of a run, as byte segments of one buffer (see the
    module docstring). Each segment starts at a multiple of its element size, so its view of a
    received byte buffer needs no copy."""

    def __init__(self, segments: list[Segment]):
        for segment in segments:
            if segment.offset % segment.itemsize or segment.numel < 0:
                raise ValueError(f"segment {segment.name!r} at byte {segment.offset} is not aligned to its "
                                 f"{segment.itemsize}-byte {segment.dtype} values")
        self.segments = list(segments)
        self.nbytes = max((s.stop for s in self.segments), default=0)
        dtypes = {s.dtype for s in self.segments}
        self.dtype: torch.dtype | None = dtypes.pop() if len(dtypes) == 1 else None  # None: mixed

    @classmethod
    def uniform(cls, ranges: Mapping[str, tuple[int, int]], dtype: torch.dtype) -> "TensorLayout":
        """A flat state's layout: segments of one ``dtype`` at the element ``ranges`` given."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls([Segment(name, dtype, b - a, a * itemsize) for name, (a, b) in ranges.items()])

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> "TensorLayout":
        """The layout of messages shaped like ``tensors``, back to back, widest elements first (so
        every segment is aligned)."""
        order = sorted(tensors.items(), key=lambda item: -item[1].element_size())  # stable: ties keep their order
        segments, offset = [], 0
        for name, tensor in order:
            segments.append(Segment(name, tensor.dtype, tensor.numel(), offset))
            offset += tensor.numel() * tensor.element_size()
        return cls(segments)

    def ordered(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` in the layout's order, flattened; WireError unless they are exactly its
        tensors, of its dtypes and sizes."""
        if tensors.keys() != {s.name for s in self.segments}:
            raise WireError(f"the message's tensors {sorted(tensors)[:4]} are not the layout's "
                            f"{[s.name for s in self.segments][:4]}")
        out = {}
        for segment in self.segments:
            tensor = tensors[segment.name]
            if tensor.dtype != segment.dtype or tensor.numel() != segment.numel:
                raise WireError(f"tensor {segment.name!r} is {tensor.numel()} {tensor.dtype} values, the layout "
                                f"says {segment.numel} {segment.dtype}")
            out[segment.name] = tensor.reshape(-1)
        return out

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of a message held in ``buffer`` (uint8, ``nbytes`` long), as views of it."""
        return {s.name: buffer[s.offset:s.stop].view(s.dtype) for s in self.segments}

    def pack(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The message's bytes (a new uint8 tensor), as a chunking transport sends them."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        for name, tensor in self.ordered(tensors).items():
            segment = next(s for s in self.segments if s.name == name)
            buffer[segment.offset:segment.stop].view(segment.dtype).copy_(tensor)
        return buffer

    def received(self, tensors: Mapping[str, torch.Tensor], chunk_present: torch.Tensor,
                 chunk_bytes: int) -> dict[str, torch.Tensor]:
        """``tensors`` as a receiver holds them when only the chunks ``chunk_present`` says (of
        ``chunk_bytes``) arrived: the lost chunks' bytes read as zeros (the batched engine's model
        of a UDP transfer)."""
        buffer = self.pack(tensors)
        zero_lost_chunks(buffer, torch.nonzero(~chunk_present.to(torch.bool).cpu()).flatten().tolist(), chunk_bytes)
        return self.views(buffer)

    def presence(self, chunk_present: torch.Tensor, chunk_bytes: int) -> dict[str, torch.Tensor]:
        """Which elements of each tensor arrived, from which of the message's chunks of
        ``chunk_bytes`` did (``chunk_present``: bool, one per chunk). An element lies in one chunk:
        chunk sizes are multiples of 8 and segments are aligned."""
        present = chunk_present.to(torch.bool).cpu()
        out = {}
        for segment in self.segments:
            starts = segment.offset + torch.arange(segment.numel, dtype=torch.int64) * segment.itemsize
            out[segment.name] = present[starts // chunk_bytes]
        return out


def zero_lost_chunks(buffer: torch.Tensor, lost: Iterable[int], chunk_bytes: int) -> None:
    """In place: the bytes of the ``lost`` chunks (their indices) set to zero (``buffer``: uint8),
    so they read as zeros, never as an earlier message's bytes."""
    for index in lost:
        buffer[index * chunk_bytes:(index + 1) * chunk_bytes].zero_()
